"""EAGLE-3 heads (models/eagle3.py, speculative/eagle3.py) against the reference implementation, vLLM's `speculators`
library (speculators/models/eagle3: Eagle3DraftModel, Eagle3SpeculatorConfig), on random weights over tiny
targets: the chain's logits and greedy drafts as the reference's test-time-training steps compute them (qwen3 layers
over a draft vocabulary mapped by d2t; two llama layers reading the target's embedding table, with the config's norm
options), speculation with it exactly plain decoding (greedy, seeded, in a batch, with a prompt resent, n-gram lookup
in front), the sampled distribution (chi-square), and the head described to the memory plan, tune and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.draft import Draft, DraftBuilder
from quickdraft.weights.loader import load_model
from tests.helpers import (PROMPT, assert_resent_and_batched_equal_plain, plain_tokens, save_hf_dir, tiny_hf_model,
                           tokens_of as run)

try:  # the suite's setup installs it (scripts/setup-venv.sh test): its absence fails the suite, never skips it
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
except ImportError as e:
    raise ImportError("tests/test_eagle3.py checks against vLLM's speculators library: pip install --no-deps "
                      "speculators==0.9.0 hs-connectors==0.9.0 and datasets (scripts/setup-venv.sh test does)") from e

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
LAYERS = 6
# (layer family, head layers, draft vocabulary (0: the target's), the config's options, its own embedding table)
VARIANTS = {
    "qwen3-d2t": ("qwen3", 1, 200, {}, True),
    "llama-norms": ("llama", 2, 0, {"norm_before_residual": True, "fc_norm": True, "norm_output": True}, False),
    "llama-fc-norm": ("llama", 1, 160, {"norm_before_fc": True}, True),
}


def reference_head(variant: str, target, tdir, seed: int = 3, ids=(1, 3, 5), width: int | None = None,
                   vocab: int | None = None, draft_vocab: int | None = None):
    """A random EAGLE-3 head for `target` (a transformers model saved at tdir), as the library builds it (eager
    attention: its CPU path), its norms randomised and its weights scaled up for peaked guesses, with a random
    draft vocabulary map where the variant has one; without its own embedding table it reads the target's."""
    import transformers

    family, layers, mapped, options, own = VARIANTS[variant]
    draft_vocab = mapped if draft_vocab is None else draft_vocab
    tc = target.config
    V = vocab or tc.vocab_size
    sizes = dict(vocab_size=V, hidden_size=width or tc.hidden_size, intermediate_size=80, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                 rms_norm_eps=1e-6)
    layer = (transformers.Qwen3Config(rope_theta=1e6, **sizes) if family == "qwen3" else
             transformers.LlamaConfig(rope_theta=5e5, mlp_bias=True, **sizes))
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab or V, eagle_aux_hidden_state_layer_ids=list(ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(tdir), architectures=["Qwen3ForCausalLM"])), **options)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config).eval()
    if draft_vocab:
        kept = sorted(torch.randperm(V)[:draft_vocab].tolist())
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        model.load_vocab_mappings(t2d, torch.tensor(kept) - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif torch.isnan(p).any():  # the tables the library leaves to the verifier's weights
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(3.0)
        if not own:
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    return model


def save_head(model, path, own: bool = True):
    """save_pretrained; without its embedding table where the head reads the target's (as published heads ship)."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)
    if not own:
        tensors = load_file(str(path / "model.safetensors"))
        del tensors["embed_tokens.weight"]
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    hf = tiny_hf_model("qwen3", layers=LAYERS, logit_scale=4)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("eagle3-target"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def head_dir(request, target_dir, tmp_path_factory):
    hf_target, tdir = target_dir
    model = reference_head(request.param, hf_target, tdir)
    path = save_head(model, tmp_path_factory.mktemp(request.param), VARIANTS[request.param][4])
    return request.param, model, path


def build(target, path, config, speculation=SpeculationConfig(), text=None):
    return DraftBuilder(target, config, 256).drafter(Draft.parse(text or str(path)), speculation)


def _reference_steps(hf_target, model, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """The reference's logits at the pending token's pair for each of len(drafts) + 1 test-time-training steps, its
    later steps fed `drafts` (the steps teacher-force the sequence's next tokens: the drafts are put there), mapped
    onto the target's vocabulary (-inf where the draft vocabulary has no token)."""
    committed = len(tokens) - 1
    with torch.no_grad():
        hidden = hf_target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i] for i in model.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    pad = torch.zeros(1, len(drafts), aux.shape[-1])  # the drafts' own rows: later in the sequence, never read here
    ids = torch.tensor([tokens[1:] + drafts])
    n = ids.shape[1]
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[0, committed - 1].clone()))
    try:
        with torch.no_grad():
            model(torch.cat([aux, pad], dim=1), ids, torch.zeros(1, n, dtype=torch.long),
                  position_ids=torch.arange(n)[None], ttt_steps=len(drafts) + 1)
    finally:
        hook.remove()
    V = hf_target.config.vocab_size
    targets = torch.arange(model.draft_vocab_size) + (model.d2t if model.use_draft_vocab else 0)
    return [torch.full((V,), float("-inf")).scatter_(0, targets, step.float()) for step in seen]


def test_the_chain_equals_the_reference(target_dir, head_dir):
    """Two rounds (the prompt's pairs, then two more committed tokens taken in beside the cached ones), each a chain of
    three: the target's states the head reads, each step's logits over the draft vocabulary (placed at the target ids
    d2t maps them to) and its greedy draft, as the reference's test-time-training steps compute them (float32)."""
    hf_target, tdir = target_dir
    variant, model, path = head_dir
    target = load_model(str(tdir), F32, progress=False)
    drafter = build(target, path, F32)
    assert drafter.kind == "eagle3" and drafter.head.config.aux_layers == (1, 3, 5)
    assert drafter.head.config.own_embedding == VARIANTS[variant][4]
    cache = KVCache.for_model(target.model, 64)
    drafter.attach(cache)
    rounds = [PROMPT + [13], PROMPT + [13, 200, 7]]
    with torch.no_grad():
        hidden = hf_target(torch.tensor([rounds[-1]]), output_hidden_states=True).hidden_states
        target.model(torch.tensor([rounds[-1][:-1]]), cache)
        want = torch.cat([hidden[i] for i in (1, 3, 5)], dim=-1)[0, :-1]
        assert float((cache.features[:cache.length] - want).abs().max()) <= 1e-5
        cache.rollback(len(PROMPT))
        for tokens in rounds:
            committed = len(tokens) - 1
            if cache.length < committed:
                target.model(torch.tensor([tokens[cache.length:committed]]), cache)
            drafter.cache.rollback(min(drafter.cache.length, committed - 1))
            drafter.chain, logits, drafts, token = (tokens, committed), [], [], tokens[-1]
            for _ in range(3):
                logits.append(drafter._logits([token]).float())
                token = int(logits[-1].argmax())
                drafts.append(token)
            want = _reference_steps(hf_target, model, tokens, drafts[:-1])
            for ours, theirs in zip(logits, want):
                drafted = theirs > float("-inf")
                error = float((ours[drafted] - theirs[drafted]).abs().max())
                print(f"{variant} step against the reference: logits {error:.1e}")
                assert error <= 1e-4 * max(1.0, float(theirs[drafted].abs().max()))
                assert int(ours.argmax()) == int(theirs.argmax())
                if not drafted.all():  # a token the head cannot propose scores below every one it can
                    assert float(ours[~drafted].max()) < float(ours[drafted].min())
            drafter.cache.rollback(committed)  # the chain's entries dropped, as a round drops them


@pytest.mark.parametrize("config", [F32, BF16], ids=["f32", "bf16"])
def test_speculation_equals_plain(target_dir, head_dir, config):
    """Greedy (adaptive k, and fixed k with trees), seeded (with a penalty) and with n-gram lookup in front: the
    output is plain decoding's, and the head drafted."""
    _, tdir = target_dir
    _, _, path = head_dir
    target = load_model(str(tdir), config, progress=False)
    cases = [(SamplingParams(max_tokens=40, stop_at_eos=False), SpeculationConfig()),
             (SamplingParams(max_tokens=40, stop_at_eos=False), SpeculationConfig(draft_max=4, adaptive=False, tree=3)),
             (SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=40, stop_at_eos=False),
              SpeculationConfig(draft_max=4, adaptive=False)),
             (SamplingParams(temperature=0.7, seed=11, max_tokens=40, stop_at_eos=False, repetition_penalty=1.2),
              SpeculationConfig(draft_max=3, adaptive=False))]
    for params, spec in cases:
        plain = plain_tokens(target, params)
        ours, final = run(Engine(target, 256, build(target, path, config, spec), spec), params)
        assert ours == plain and final.stats.draft_n > 0 and "eagle3" in final.stats.sources
    greedy = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain = plain_tokens(target, greedy)
    combined = build(target, path, config, SpeculationConfig(), text=f"ngram+{path}")
    assert combined.reads_hidden
    ours, _ = run(Engine(target, 256, combined, SpeculationConfig()), greedy)
    assert ours == plain


@pytest.mark.parametrize("order", ["ngram,{}", "{},ngram"])
def test_chained_with_lookup(target_dir, order):
    """The head chained with n-gram lookup, either first: greedy and seeded output is plain decoding's over a prompt
    that repeats itself; greedy with lookup first, both draft (lookup where it matches, the head elsewhere)."""
    hf_target, tdir = target_dir
    path = save_head(reference_head("qwen3-d2t", hf_target, tdir), tdir.parent / f"chained-{order[0]}")
    target = load_model(str(tdir), BF16, progress=False)
    text = order.format(path)
    assert Draft.parse(text).kind == "chain" and str(Draft.parse(text)) == text
    for params in (SamplingParams(max_tokens=40, stop_at_eos=False),
                   SamplingParams(temperature=0.8, seed=4, max_tokens=40, stop_at_eos=False)):
        plain, _ = run(Engine(target, 256), params, PROMPT * 3)
        drafter = build(target, path, BF16, text=text)
        assert drafter.name == text and drafter.sources in (("ngram", "eagle3"), ("eagle3", "ngram"))
        ours, final = run(Engine(target, 256, drafter, SpeculationConfig()), params, PROMPT * 3)
        assert ours == plain and final.stats.draft_n > 0
        if order.startswith("ngram") and params.greedy:  # (greedy, the target repeats itself here)
            assert {"ngram", "eagle3"} <= set(final.stats.sources)


def test_a_resent_prompt_and_a_batch(target_dir, head_dir):
    """The same prompt twice on one engine (the head keeps its pairs of the prompt: its first pass takes in none),
    and three sequences in a batch: each answer is plain decoding's, alone or beside the others."""
    _, tdir = target_dir
    _, _, path = head_dir
    target = load_model(str(tdir), BF16, progress=False)
    assert_resent_and_batched_equal_plain(target, lambda spec: build(target, path, BF16, spec))


def test_sampled_output_has_the_target_distribution(tmp_path):
    """Unseeded at T = 0.7 with chains of 2 drafts from a head over 16 of the target's 24 tokens: the second and third
    tokens emitted (from the one round verifying both drafts) follow the target's two- and three-step distributions
    (chi-square), though the head never proposes a third of them."""
    from tests.helpers import assert_second_and_third_follow, second_and_third_drawn, two_and_three_step

    hf = tiny_hf_model("qwen3", layers=LAYERS, vocab=24, logit_scale=2)
    tdir = save_hf_dir(hf, tmp_path / "t")
    path = save_head(reference_head("qwen3-d2t", hf, tdir, draft_vocab=16), tmp_path / "d")
    target = load_model(str(tdir), F32, progress=False)
    prompt, V = [1, 2, 3], target.config.vocab_size
    params = SamplingParams(temperature=0.7, max_tokens=4, stop_at_eos=False)
    exact = two_and_three_step(target, prompt, params)
    spec = SpeculationConfig(draft_max=2, adaptive=False, p_min=0.0)
    engine = Engine(target, 16, build(target, path, F32, spec), spec)
    counts, accepted = second_and_third_drawn(engine, prompt, params, V)
    assert accepted > 0
    assert_second_and_third_follow(counts, exact)


def _exports(profile: dict, path) -> None:
    """A profile that picks the head, alone or chained before n-gram lookup, as each engine's EAGLE-3 flags, and as
    its config in the speculators format, which the library itself loads (the tuned k, the target as verifier)."""
    import shlex
    import shutil

    from quickdraft.tools import export

    alone = {**profile, "draft": str(path), "draft_kind": "eagle3", "draft_max": 4}
    text = export.export(alone, "speculators")
    body = text.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    assert text.splitlines()[-1] == f"vllm serve {path}"
    copy = path.parent / f"{path.name}-exported"
    shutil.copytree(path, copy, dirs_exist_ok=True)
    (copy / "config.json").write_text(body)
    loaded = Eagle3DraftModel.from_pretrained(str(copy))
    method = loaded.config.speculators_config.proposal_methods[0]
    verifier = loaded.config.speculators_config.verifier
    assert method.speculative_tokens == 4 and verifier.name_or_path == profile["target"]
    with pytest.raises(QuickdraftError, match="export this one as vllm flags"):
        export.export({**alone, "draft": "ngram"}, "speculators")
    chained = {**alone, "draft": f"{path},ngram", "draft_kind": "chain", "draft_kinds": ["eagle3", "ngram"]}
    for engine in export.ENGINES:
        for chosen in (alone, chained):
            text = export.export(chosen, engine, "/models/t.gguf")
            (command,) = [line for line in text.splitlines() if not line.startswith("#")]
            argv = shlex.split(command)
            flags = dict(zip(argv[1:], argv[2:]))
            if engine == "llama-server":
                types = "draft-eagle3,ngram-simple" if chosen is chained else "draft-eagle3"
                assert flags["--spec-type"] == types and flags["-md"] == f"{path}.gguf"
                assert flags["--spec-draft-n-max"] == "4" and "#18039" in text
            elif engine == "vllm":
                assert json.loads(flags["--speculative-config"]) == {"method": "eagle3", "model": str(path),
                                                                     "num_speculative_tokens": 4}
                assert ("no n-gram lookup" in text) == (chosen is chained)
            else:
                assert flags["--speculative-algorithm"] == "EAGLE3" and flags["--speculative-num-steps"] == "4"
                assert flags["--speculative-num-draft-tokens"] == "5"


def test_recognised_planned_replayed_ranked_and_refused(target_dir, head_dir, tmp_path):
    """--draft DIR is the eagle3 kind; the memory plan made before loading counts what the built head holds; tune's
    replay over an output made of the target's first token and a round's own drafts keeps them all, and tune ranks
    the head beside n-gram lookup; a head made for another target (its width, its vocabulary, layers the target lacks)
    is a one-line error naming the mismatch; a config naming no layer ids reads the library's default ones."""
    import quickdraft
    from quickdraft.api import memory_plan
    from quickdraft.tools import tune

    hf_target, tdir = target_dir
    variant, _, path = head_dir
    assert Draft.parse(str(path)).kind == "eagle3" and str(Draft.parse(f"ngram+{path}")) == f"ngram+{path}"
    target = load_model(str(tdir), F32, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0)
    drafter = build(target, path, F32, spec)
    engine = Engine(target, 256, drafter, spec)
    first, _ = run(engine, SamplingParams(max_tokens=1, stop_at_eos=False), PROMPT)
    proposal = drafter.propose(PROMPT + first, lambda source: 4, SamplingParams(max_tokens=8), None)
    assert len(proposal.tokens) == 4
    offers = drafter.offers(PROMPT, first + proposal.tokens, 4)
    assert offers[1].kept == 4, [o.kept for o in offers]
    plan = memory_plan(str(tdir), Draft.parse(str(path)), BF16)
    assert [i.what for i in plan.items] == ["target weights", "target KV cache", "draft weights", "draft KV cache",
                                            "activations"]
    bf16 = load_model(str(tdir), BF16, progress=False)
    built = Engine(bf16, 256, build(bf16, path, BF16), SpeculationConfig()).drafter
    assert next(i.nbytes for i in plan.items if i.what == "draft KV cache") == built.cache_bytes()
    if variant == "qwen3-d2t":
        llm = quickdraft.load(str(tdir), "none", device="cpu", dtype="bfloat16", weights="bf16", context=256,
                              progress=False)
        profile = tune.run(llm, [Draft.parse(str(path)), Draft.parse("ngram")], {"a": PROMPT, "b": PROMPT[::-1]}, 4,
                           0.0, 16, log=lambda message: None, vocab=0)
        (measured,) = [c for c in profile["candidates"] if c["name"] == str(path) and c["tree"] == 1]
        assert len(measured["acceptance"]) == 4 and measured["r"] > 0
        _exports(profile, path)
    for change, words in (({"width": 48}, "made for a target 48 wide"), ({"vocab": 300}, "of 300 tokens"),
                          ({"ids": (1, 3, 7)}, "layer ids [1, 3, 7]"), ({"ids": (0, 3, 5)}, "layer id 0")):
        other = tmp_path / "-".join(map(str, change.values()))
        save_head(reference_head("qwen3-d2t", hf_target, tdir, **change), other)
        with pytest.raises(QuickdraftError, match=words.replace("[", r"\[").replace("]", r"\]")):
            build(target, other, F32)
    broken = tmp_path / "broken"
    save_head(reference_head(variant, hf_target, tdir), broken, True)
    config = json.loads((broken / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]  # the library's default for the verifier: 2, n // 2, n - 3
    (broken / "config.json").write_text(json.dumps(config))
    assert build(target, broken, F32).head.config.aux_layers == (2, 3, 3)
    gemma = {**config, "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
             "transformer_layer_config": {**config["transformer_layer_config"], "model_type": "gemma3_text"}}
    (broken / "config.json").write_text(json.dumps(gemma))
    with pytest.raises(QuickdraftError, match="head of gemma3_text layers .*embed_scale.* is not read"):
        build(target, broken, F32)


def test_doctor_describes_the_head(target_dir, head_dir):
    """doctor names the head's vocabulary map and its caches beside the target's, gives it int8 on auto, and warns
    where it is asked to run in int4 (a head below int8 loses most of its acceptance)."""
    import quickdraft
    from quickdraft.tools import doctor

    _, tdir = target_dir
    variant, _, path = head_dir
    if variant != "qwen3-d2t":
        pytest.skip("one variant is enough")
    for weights, level in (("auto", "ok"), ("int4", "warn")):
        llm = quickdraft.load(str(tdir), str(path), device="cpu", dtype="bfloat16", weights="bf16", context=256,
                              draft_weights=weights, progress=False, cache_slots=1)
        findings, engine = doctor.run(llm, Draft.parse(str(path), weights=weights), prompt=PROMPT)
        by = {f.check: f for f in findings}
        assert by["tokenizer"].level == "ok" and "proposes 200 of the target's 320 tokens" in by["tokenizer"].message
        head = by["draft head"]
        assert head.level == level, head.message
        assert head.figures["weights"] == ("int8" if weights == "auto" else "int4")
        assert head.figures["drafter_cache_bytes"] == engine.drafter.cache_bytes() > 0
        assert engine.drafter.kind == "eagle3" and by["speculation"].figures["rounds"] > 0  # (the head drafted)
