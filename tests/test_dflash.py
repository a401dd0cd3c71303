"""DFlash and DFlash2 block drafters (models/dflash.py, speculative/dflash.py) against the reference implementation,
z-lab's `dflash` package (dflash/model.py: DFlashDraftModel, DFlash2DraftModel, dflash_generate), on random weights
over tiny targets: the target's hidden states the drafter reads, the block's logits and proposals, speculation with it
exactly plain decoding (greedy, seeded, in a batch, on a hybrid target), the sampled distribution (chi-square), and
the drafter described to the memory plan, tune's replay and its errors."""

from __future__ import annotations

import time

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.draft import Draft, DraftBuilder
from quickdraft.weights.loader import load_model
from tests.helpers import PROMPT, in_a_batch, plain_tokens, save_hf_dir, tiny_hf_model, tokens_of as run

try:  # the suite's setup installs it (scripts/setup-venv.sh test): its absence fails the suite, never skips it
    import dflash.model as dflash_ref
except ImportError as e:
    raise ImportError("tests/test_dflash.py checks against the DFlash reference implementation: "
                      "pip install --no-deps dflash==0.1.0 (scripts/setup-venv.sh test installs it)") from e

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
BLOCK = 6
LAYERS = 6  # the target's: the drafter reads layers 1 and 3 (the reference's default for 2 draft layers)


def reference_drafter(kind: str, target_config, seed: int = 4, width: int | None = None):
    """A random DFlash (2 layers) or DFlash2 drafter for a target, as the reference builds it; its norms and
    convolution kernels randomised so that every parameter matters, its weights scaled up for peaked guesses."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=target_config.vocab_size, hidden_size=width or target_config.hidden_size, intermediate_size=80,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
        max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg.num_target_layers = target_config.num_hidden_layers
    cfg.dflash_config = {"block_size": BLOCK, "mask_token_id": target_config.vocab_size - 1}
    if kind == "dflash2":
        cfg.dflash_config |= {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 12}
    torch.manual_seed(seed)
    model = (dflash_ref.DFlash2DraftModel if kind == "dflash2" else dflash_ref.DFlashDraftModel)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "base_kernel" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    hf = tiny_hf_model("qwen3", layers=LAYERS, logit_scale=4)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("dflash-target"))


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def drafter_dir(request, target_dir, tmp_path_factory):
    hf_target, _ = target_dir
    model = reference_drafter(request.param, hf_target.config)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def build(target, path, config, speculation=SpeculationConfig(), text=None):
    return DraftBuilder(target, config, 256).drafter(Draft.parse(text or str(path)), speculation)


def _reference_block(hf_target, model, tokens: list[int], cache, start: int):
    """The reference's drafting pass after `tokens` (the last one pending), its draft cache holding the context up
    to `start`: (logits (B - 1, V), greedy proposal (B - 1,))."""
    ids = torch.tensor([tokens])
    committed = len(tokens) - 1
    out = hf_target(ids[:, :committed], output_hidden_states=True)
    context = dflash_ref.extract_context_feature(out.hidden_states, model.target_layer_ids)[:, start:committed]
    block = torch.tensor([[tokens[-1]] + [model.mask_token_id] * (BLOCK - 1)])
    noise = dflash_ref._raw_input_embeddings(hf_target, block)
    positions = torch.arange(start, committed + BLOCK)[None]
    hidden = model(target_hidden=context, noise_embedding=noise, position_ids=positions, past_key_values=cache,
                   use_cache=True)[:, 1 - BLOCK:, :]
    dflash_ref._crop_to(cache, committed)
    logits = model.compute_logits(hidden, dflash_ref._output_head(hf_target))[0]
    if isinstance(model, dflash_ref.DFlash2DraftModel):
        proposal = model.propose(hidden, block[:, 0], dflash_ref._output_head(hf_target), 0.0)[0][0]
    else:
        proposal = logits.argmax(-1)
    return logits, proposal


def test_the_block_equals_the_reference(target_dir, drafter_dir):
    """Two rounds (the prompt's context, then two more committed tokens taken in beside the cached ones): the
    target's hidden states the drafter reads, the block's logits and its greedy proposal, as the reference computes
    them from transformers' hidden states (float32)."""
    hf_target, tdir = target_dir
    kind, model, path = drafter_dir
    rounds = [PROMPT + [13], PROMPT + [13, 200, 7]]
    target = load_model(str(tdir), F32, progress=False)
    drafter = build(target, path, F32)
    assert drafter.kind == "dflash" and drafter.drafter.config.kind == kind
    assert list(drafter.drafter.config.target_layers) == model.target_layer_ids == [1, 3]
    cache = KVCache.for_model(target.model, 64)
    drafter.attach(cache)
    ref_cache = dflash_ref._make_cache(model.config)
    with torch.no_grad():
        hidden = hf_target(torch.tensor([rounds[-1]]), output_hidden_states=True).hidden_states
        target.model(torch.tensor([rounds[-1][:-1]]), cache)
        want = dflash_ref.extract_context_feature(hidden, model.target_layer_ids)[0, :-1]
        assert float((cache.features[:cache.length] - want).abs().max()) <= 1e-5
        cache.rollback(len(PROMPT))
        start = 0
        for tokens in rounds:
            committed = len(tokens) - 1
            if cache.length < committed:
                target.model(torch.tensor([tokens[cache.length:committed]]), cache)
            logits_want, proposal_want = _reference_block(hf_target, model, tokens, ref_cache, start)
            drafter.cache.rollback(min(drafter.cache.length, committed))
            drafter._block(tokens[-1], committed)
            error = float((drafter.logits - logits_want).abs().max())
            print(f"{kind} block against the reference: logits {error:.1e}")
            assert error <= 1e-4 * max(1.0, float(logits_want.abs().max()))
            chosen, token = [], tokens[-1]
            for _ in range(BLOCK - 1):
                token = int(drafter._logits([token]).argmax())
                chosen.append(token)
            assert chosen == proposal_want.tolist()
            assert drafter.cache.length == committed
            start = committed


@pytest.fixture(scope="module")
def reference_run(target_dir, drafter_dir):
    """The reference's greedy generation with its drafter (dflash_generate), and the proposal of each of its full
    blocks."""
    hf_target, _ = target_dir
    kind, model, _ = drafter_dir
    proposals = []
    if kind == "dflash2":
        propose = model.propose

        def record(*args, **kwargs):
            out = propose(*args, **kwargs)
            proposals.append(out[0][0].tolist())
            return out
        model.propose = record
    else:
        compute = model.compute_logits

        def record(*args, **kwargs):
            out = compute(*args, **kwargs)
            proposals.append(out[0].argmax(-1).tolist())
            return out
        model.compute_logits = record
    saved = dflash_ref._cuda_time
    dflash_ref._cuda_time = time.perf_counter  # its statistics time CUDA; the CPU's clock does here
    try:
        out = dflash_ref.dflash_generate(model, hf_target, torch.tensor([PROMPT]), 40, None, return_stats=True)
    finally:
        dflash_ref._cuda_time = saved
        model.__dict__.pop("propose", None)
        model.__dict__.pop("compute_logits", None)
    return out.output_ids[0, len(PROMPT):].tolist(), out.acceptance_lengths, proposals


def test_greedy_speculation_equals_plain_and_the_reference(target_dir, drafter_dir, reference_run):
    """Fixed k = B - 1: the output is plain decoding's and the reference's; each round proposes what the reference's
    round at the same position proposed, and keeps as many."""
    _, tdir = target_dir
    kind, _, path = drafter_dir
    want, lengths, ref_proposals = reference_run
    target = load_model(str(tdir), F32, progress=False)
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    assert plain == want[:40]
    spec = SpeculationConfig(draft_max=BLOCK - 1, adaptive=False, p_min=0.0)  # no early stop: the reference has none
    drafter = build(target, path, F32, spec)
    proposals = []
    propose = drafter.propose

    def record(*args, **kwargs):
        out = propose(*args, **kwargs)
        proposals.append(out.tokens)
        return out
    drafter.propose = record
    ours, final = run(Engine(target, 256, drafter, spec), params)
    assert ours == plain
    full = [p for p, n in zip(ref_proposals, lengths) if len(p) == BLOCK - 1]
    assert len(full) >= 5 and proposals[:len(full) - 1] == full[:len(full) - 1]
    assert final.stats.rounds > 0 and "dflash" in final.stats.sources


@pytest.mark.parametrize("config", [F32, BF16], ids=["f32", "bf16"])
def test_seeded_speculation_and_lookup_in_front_equal_plain(target_dir, drafter_dir, config):
    _, tdir = target_dir
    _, _, path = drafter_dir
    target = load_model(str(tdir), config, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False)
    for params in (SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=40, stop_at_eos=False),
                   SamplingParams(temperature=0.7, seed=11, max_tokens=40, stop_at_eos=False, repetition_penalty=1.2)):
        plain = plain_tokens(target, params)
        ours, final = run(Engine(target, 256, build(target, path, config, spec), spec), params)
        assert ours == plain and final.stats.draft_n > 0
    greedy = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain = plain_tokens(target, greedy)
    combined = build(target, path, config, SpeculationConfig(), text=f"ngram+{path}")
    assert combined.reads_hidden and combined.per_round == ("dflash",)
    ours, final = run(Engine(target, 256, combined, SpeculationConfig()), greedy)
    assert ours == plain


def test_a_resent_prompt_reuses_the_drafters_context(target_dir, drafter_dir):
    """The same prompt twice on one engine (its slot keeps the prompt's positions, and the drafter their context
    rows: its first block then takes in none): both answers are plain decoding's."""
    _, tdir = target_dir
    _, _, path = drafter_dir
    target = load_model(str(tdir), BF16, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False)
    params = SamplingParams(max_tokens=20, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params, PROMPT * 2)
    engine = Engine(target, 256, build(target, path, BF16, spec), spec)
    for _ in range(2):
        ours, final = run(engine, params, PROMPT * 2)
        assert ours == plain and final.stats.draft_n > 0
    assert final.timings.cache_n > 0  # the second reused the first's positions


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_sampled_output_has_the_target_distribution(tmp_path, kind):
    """Unseeded at T = 0.7 with chains of 2 drafts, over a vocabulary of 24 (where a random drafter's guesses are often
    accepted): the second and third tokens emitted (from the one round verifying both drafts: each a kept draft or the
    residual after a rejection) are distributed as the target's two- and three-step distributions (chi-square)."""
    from tests.helpers import assert_second_and_third_follow, second_and_third_drawn, two_and_three_step

    hf = tiny_hf_model("qwen3", layers=LAYERS, vocab=24, logit_scale=2)
    tdir = save_hf_dir(hf, tmp_path / "t")
    reference_drafter(kind, hf.config).save_pretrained(tmp_path / "d")
    path = tmp_path / "d"
    target = load_model(str(tdir), F32, progress=False)
    prompt, V = [1, 2, 3], target.config.vocab_size
    params = SamplingParams(temperature=0.7, max_tokens=4, stop_at_eos=False)  # a draft budget of 2 after the first
    exact = two_and_three_step(target, prompt, params)
    spec = SpeculationConfig(draft_max=2, adaptive=False, p_min=0.0)
    engine = Engine(target, 16, build(target, path, F32, spec), spec)
    counts, accepted = second_and_third_drawn(engine, prompt, params, V)
    assert accepted > 0
    assert_second_and_third_follow(counts, exact)


def test_sequences_in_a_batch_get_what_they_get_alone(target_dir, drafter_dir):
    _, tdir = target_dir
    _, _, path = drafter_dir
    target = load_model(str(tdir), BF16, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False)
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], PROMPT[3:] * 3]
    params = [SamplingParams(max_tokens=20, stop_at_eos=False),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, stop_at_eos=False),
              SamplingParams(max_tokens=16, stop_at_eos=False)]
    want = [run(Engine(target, 256, build(target, path, BF16, spec), spec), p, prompt)[0]
            for prompt, p in zip(prompts, params)]
    got, _ = in_a_batch(Engine(target, 256, build(target, path, BF16, spec), spec, slots=4), prompts, params)
    assert got == want


def test_on_a_hybrid_target(tmp_path):
    """A Qwen3.5 target (linear-attention layers with recurrent states rolled back after rejections): the hidden
    states the drafter reads are transformers', its block the reference's, and speculation is plain decoding."""
    from tests.test_hybrid import tiny_qwen35

    hf = tiny_qwen35(layers=4, logit_scale=4)
    tdir = save_hf_dir(hf, tmp_path / "t")
    model = reference_drafter("dflash", hf.config)
    model.save_pretrained(tmp_path / "d")
    target = load_model(str(tdir), F32, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False)
    drafter = build(target, tmp_path / "d", F32, spec)
    assert list(drafter.drafter.config.target_layers) == model.target_layer_ids == [1, 1]  # a layer twice
    tokens = PROMPT + [13]
    cache = KVCache.for_model(target.model, 64)
    drafter.attach(cache)
    with torch.no_grad():
        target.model(torch.tensor([tokens[:-1]]), cache)
        logits_want, _ = _reference_block(hf, model, tokens, dflash_ref._make_cache(model.config), 0)
        drafter._block(tokens[-1], len(tokens) - 1)
    assert float((drafter.logits - logits_want).abs().max()) <= 1e-4 * max(1.0, float(logits_want.abs().max()))
    for params in (SamplingParams(max_tokens=30, stop_at_eos=False),
                   SamplingParams(temperature=0.8, seed=2, max_tokens=30, stop_at_eos=False)):
        plain, _ = run(Engine(target, 256), params)
        ours, final = run(Engine(target, 256, drafter, spec), params)
        assert ours == plain and final.stats.draft_n > 0


def test_recognised_planned_replayed_and_refused(target_dir, drafter_dir, tmp_path):
    """--draft DIR is the dflash kind; the memory plan made before loading counts what the built drafter holds;
    tune's replay over an output made of the target's first token and a round's own drafts keeps them all; a
    drafter made for another target is a one-line error naming the fix."""
    from quickdraft.api import memory_plan

    hf_target, tdir = target_dir
    kind, _, path = drafter_dir
    assert Draft.parse(str(path)).kind == "dflash" and str(Draft.parse(f"ngram+{path}")) == f"ngram+{path}"
    target = load_model(str(tdir), F32, progress=False)
    spec = SpeculationConfig(draft_max=BLOCK - 1, adaptive=False, p_min=0.0)  # no early stop: the replay has none
    drafter = build(target, path, F32, spec)
    engine = Engine(target, 256, drafter, spec)
    first, _ = run(engine, SamplingParams(max_tokens=1, stop_at_eos=False), PROMPT)
    proposal = drafter.propose(PROMPT + first, lambda source: BLOCK - 1, SamplingParams(max_tokens=8), None)
    assert len(proposal.tokens) == BLOCK - 1
    offers = drafter.offers(PROMPT, first + proposal.tokens, BLOCK - 1)
    assert offers[1].kept == BLOCK - 1, [o.kept for o in offers]
    plan = memory_plan(str(tdir), Draft.parse(str(path)), BF16)
    assert [i.what for i in plan.items] == ["target weights", "target KV cache", "draft weights", "draft KV cache",
                                            "activations"]
    bf16 = load_model(str(tdir), BF16, progress=False)
    built = Engine(bf16, 256, build(bf16, path, BF16), SpeculationConfig()).drafter
    planned = next(i.nbytes for i in plan.items if i.what == "draft KV cache")
    assert planned == built.cache_bytes()  # its keys and values (a block past the context too), the target's states
    reference_drafter(kind, hf_target.config, width=48).save_pretrained(tmp_path)
    with pytest.raises(QuickdraftError, match="made for a target of 48 wide"):
        build(target, tmp_path, F32)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_tree_replay_matches_the_engine(tmp_path, kind):
    """tune's replay of trees (each block's chain past its first wrong guess: where its least sure position is, and
    the rank of the target's token there) runs the rounds the engine runs with --draft-tree 3, over a vocabulary of
    24 where a random drafter's candidates are often kept."""
    from quickdraft.tools.tune import Costs, reference, simulate

    hf = tiny_hf_model("qwen3", layers=LAYERS, vocab=24, logit_scale=2)
    tdir = save_hf_dir(hf, tmp_path / "t")
    reference_drafter(kind, hf.config).save_pretrained(tmp_path / "d")
    target = load_model(str(tdir), F32, progress=False)
    prompt, k, n = [1, 5, 9, 3, 7, 2], 2, 60
    outputs, _ = reference(target, {"p": prompt}, n)
    spec = SpeculationConfig(draft_max=k, adaptive=False, p_min=0.0, tree=3)
    events = list(Engine(target, 256, build(target, tmp_path / "d", F32, spec), spec).generate(
        prompt, SamplingParams(max_tokens=n, stop_at_eos=False)))
    assert [e.token for e in events if e.token is not None] == outputs["p"]
    stats = events[-1].stats
    replayed = build(target, tmp_path / "d", F32, spec)
    costs = Costs(1.0, {i: 1.0 for i in range(1, k + 1)}, 0.0, 0.0, {3: {i: 1.0 for i in range(1, k + 1)}})
    sim = simulate(replayed.offers(prompt, outputs["p"], k), k, costs, replayed.replay_round, width=3)
    assert stats.tree_rounds >= 3 and stats.tree_alternatives_kept > 0
    assert (sim["rounds"], sim["plain"], sim["trees"], sim["alternatives"]) == \
        (stats.rounds, stats.plain_steps, stats.tree_rounds, stats.tree_alternatives_kept)


def test_tune_ranks_the_drafter_and_exports_its_flags(target_dir, drafter_dir):
    """tune measures the DFlash drafter beside n-gram lookup by replaying its blocks over the target's output, and a
    profile that picks it exports each engine's DFlash method."""
    import json
    import shlex

    import quickdraft
    from quickdraft.tools import export, tune

    _, tdir = target_dir
    kind, _, path = drafter_dir
    llm = quickdraft.load(str(tdir), "none", device="cpu", dtype="bfloat16", weights="bf16", context=256,
                          progress=False)
    prompts = {"a": PROMPT, "b": PROMPT[::-1]}
    profile = tune.run(llm, [Draft.parse(str(path)), Draft.parse("ngram")], prompts, 4, 0.0, 16,
                       log=lambda message: None, vocab=0)
    (measured,) = [c for c in profile["candidates"] if c["name"] == str(path) and c["tree"] == 1]
    assert [c["tree"] for c in profile["candidates"] if c["name"] == str(path)] == [1, 2, 3]  # and as trees
    assert len(measured["acceptance"]) == 4 and measured["r"] > 0 and measured["best_k"] in range(1, 5)
    assert profile["draft_kind"] == {str(path): "dflash", "ngram": "ngram", "none": "none"}[profile["draft"]]
    chosen = {**profile, "draft": str(path), "draft_kind": "dflash", "draft_max": 5}
    for engine in export.ENGINES:
        text = export.export(chosen, engine, "/models/t.gguf")
        (command,) = [line for line in text.splitlines() if not line.startswith("#")]
        argv = shlex.split(command)
        flags = dict(zip(argv[1:], argv[2:]))
        if engine == "llama-server":
            assert flags["--spec-type"] == "draft-dflash" and flags["-md"] == f"{path}.gguf"
            assert flags["--spec-draft-n-max"] == "5" and "convert_hf_to_gguf.py" in text
        elif engine == "vllm":
            assert json.loads(flags["--speculative-config"]) == {"method": "dflash", "model": str(path),
                                                                 "num_speculative_tokens": 5}
        else:
            assert flags["--speculative-algorithm"] == "DFLASH" and flags["--speculative-draft-model-path"] == str(path)
            assert flags["--speculative-num-draft-tokens"] == "6"
