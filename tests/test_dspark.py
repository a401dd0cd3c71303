"""Block drafters in vLLM's speculators form (speculators_model_type "dflash", "dflash2", "dspark":
models/dflash.py, speculative/dflash.py) against the reference implementation, the `speculators` library
(speculators/models/dflash, dflash2, dspark: DFlashDraftModel, DFlash2DraftModel (its CandidateSelector.select),
DSparkDraftModel), on random weights over a tiny target: each guess's logits (the block's
row, DSpark's Markov bias after the token before it, mapped from a draft vocabulary by d2t) and DSpark's confidence,
as the reference's forward computes them for one anchor (its loss code replaced by a recorder); speculation with
them exactly plain decoding (greedy, seeded, trees, in a batch, with a prompt resent), the sampled distribution
(chi-square), and the drafter described to the memory plan, tune, export and its errors."""

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
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
except ImportError as e:
    raise ImportError("tests/test_dspark.py checks against vLLM's speculators library: pip install --no-deps "
                      "speculators==0.9.0 hs-connectors==0.9.0 and datasets (scripts/setup-venv.sh test does)") from e

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
LAYERS, BLOCK = 6, 5
# (model type, draft vocabulary (0: the target's), the config's options)
VARIANTS = {
    "dflash": ("dflash", 0, {}),
    "dflash2": ("dflash2", 0, {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 12}),
    "dspark": ("dspark", 200, {"markov_rank": 8}),
    "dspark-gated": ("dspark", 0, {"markov_rank": 8, "markov_head_type": "gated",
                                   "confidence_head_with_markov": False}),
    "dspark-rnn": ("dspark", 160, {"markov_rank": 8, "markov_head_type": "rnn", "sample_from_anchor": False}),
}


def reference_drafter(variant: str, hf_target, seed: int = 5, ids=(2, 4), width: int | None = None,
                      draft_vocab: int | None = None):
    """A random DFlash or DSpark drafter of 2 layers for hf_target, as the library builds it (eager attention), its
    norms randomised and weights scaled up for peaked guesses; the target's embedding table (and its head, over the
    whole vocabulary), as the library loads them from the verifier. No verifier named: the library then takes the plain
    final-norm convention (x * w), the tiny Qwen3 target's, without looking a name up on the Hub (a made-up name cost
    23 s of retries offline, to reach the same convention)."""
    import transformers

    kind, mapped, options = VARIANTS[variant]
    draft_vocab = mapped if draft_vocab is None else draft_vocab
    tc = hf_target.config
    V = tc.vocab_size
    layer = transformers.Qwen3Config(
        vocab_size=V, hidden_size=width or tc.hidden_size, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=256,
        rms_norm_eps=1e-6)
    layer._attn_implementation = "eager"
    speculators = SpeculatorsConfig(
        algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
        default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[]))
    config_class, model_class = {"dspark": (DSparkSpeculatorConfig, DSparkDraftModel),
                                 "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
                                 "dflash": (DFlashSpeculatorConfig, DFlashDraftModel)}[kind]
    config = config_class(transformer_layer_config=layer, draft_vocab_size=draft_vocab or V, block_size=BLOCK,
                          aux_hidden_state_layer_ids=list(ids), mask_token_id=V - 1, speculators_config=speculators,
                          **options)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if draft_vocab:
        kept = sorted(torch.randperm(V)[:draft_vocab].tolist())
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        model.load_vocab_mappings(t2d, torch.tensor(kept) - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif torch.isnan(p).any():
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "markov_w1" in name or "codebook" in name:
                p.copy_(torch.randn_like(p))  # (initialised at 0.01 or 0.02: a bias that would not matter)
            elif "base_kernel" in name or "kernel_projection" in name:
                p.copy_(0.3 * torch.randn_like(p))  # (initialised as the identity)
            else:
                p.mul_(3.0)
        if (width or tc.hidden_size) == tc.hidden_size:
            model.embed_tokens.weight.copy_(hf_target.model.embed_tokens.weight)
            if not draft_vocab:
                model.lm_head.weight.copy_(hf_target.lm_head.weight)
    return model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    hf = tiny_hf_model("qwen3", layers=LAYERS, logit_scale=4)
    return hf, save_hf_dir(hf, tmp_path_factory.mktemp("dspark-target"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def drafter_dir(request, target_dir, tmp_path_factory):
    hf_target, _ = target_dir
    model = reference_drafter(request.param, hf_target)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def build(target, path, config, speculation=SpeculationConfig(), text=None):
    return DraftBuilder(target, config, 256).drafter(Draft.parse(text or str(path)), speculation)


def _reference_inputs(hf_target, model, tokens: list[int], drafts: list[int]) -> tuple:
    """The reference's forward's inputs for the one block at the pending token (tokens[-1]), the drafts after it:
    (the target's states at the layers it reads, the ids, a loss mask whose one anchor is the pending token (the only
    one its sampler can choose), the verifier's last states (the loss's: zeros), document ids)."""
    seq = tokens + drafts + [0] * (BLOCK + 1 - len(drafts))
    with torch.no_grad():
        hidden = hf_target(torch.tensor([seq]), output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i] for i in model.config.aux_hidden_state_layer_ids], dim=-1)
    T = len(seq)
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, len(tokens) - 1] = 1
    return aux, torch.tensor([seq]), loss_mask, torch.zeros(1, T, hidden[-1].shape[-1]), torch.zeros(1, T,
                                                                                                    dtype=torch.long)


def _reference_block(hf_target, model, tokens: list[int], drafts: list[int]):
    """The reference's guesses for the block at the pending token (tokens[-1]), the drafts after it as the tokens
    its Markov head conditions on: (logits over the target's vocabulary per guess (-inf where the draft vocabulary
    has no token), the confidence head's chances or None)."""
    kind = VARIANTS_KIND[type(model).__name__]
    if kind == "dflash2":
        return _reference_selection(hf_target, model, tokens, drafts), None
    seen = {}

    def record(logits, targets, *rest, **kwargs):
        seen["logits"] = logits[0].clone()
        if kind == "dspark":
            seen["confidence"] = None if rest[0] is None else rest[0][0].float().sigmoid()
        return torch.zeros(()), {}

    module = dspark_core if kind == "dspark" else dflash_core
    saved = module.compute_metrics
    module.compute_metrics = record
    try:
        with torch.no_grad():
            model(*_reference_inputs(hf_target, model, tokens, drafts), max_anchors=1)
    finally:
        module.compute_metrics = saved
    rows = seen["logits"] if model.config.sample_from_anchor else seen["logits"][1:]
    V = hf_target.config.vocab_size
    targets = torch.arange(model.draft_vocab_size) + (model.d2t if model.use_draft_vocab else 0)
    logits = torch.full((rows.shape[0], V), float("-inf")).scatter_(1, targets.expand(rows.shape[0], -1), rows.float())
    confidence = seen.get("confidence")
    if confidence is not None and not model.config.sample_from_anchor:
        confidence = confidence[1:]
    return logits, confidence


VARIANTS_KIND = {"DFlashDraftModel": "dflash", "DSparkDraftModel": "dspark", "DFlash2DraftModel": "dflash2"}


def _reference_selection(hf_target, model, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """DFlash2's guesses as the library selects them at inference (CandidateSelector.select over its backbone's
    unary logits and rows, after the tokens before each guess): its candidates' scores per guess, -inf elsewhere."""
    aux, ids, loss_mask, last, documents = _reference_inputs(hf_target, model, tokens, drafts)
    with torch.no_grad():
        hidden, unary, _, _, block = model._backbone_forward(aux, ids, loss_mask, last, documents, max_anchors=1)
        candidates, scores = model.candidate_selector.select(unary, hidden, model._predecessor_ids(ids, block)
                                                             .reshape(1, -1))
    first = 0 if model.config.sample_from_anchor else 1
    candidates, scores = candidates[0, first:], scores[0, first:].float()
    return torch.full((candidates.shape[0], hf_target.config.vocab_size), float("-inf")).scatter_(1, candidates, scores)


def test_the_block_equals_the_reference(target_dir, drafter_dir):
    """Two rounds (the prompt's context, then two more committed tokens beside the cached ones): each guess's logits
    and greedy choice, DSpark's confidence, as the reference computes them (float32)."""
    hf_target, tdir = target_dir
    variant, model, path = drafter_dir
    target = load_model(str(tdir), F32, progress=False)
    drafter = build(target, path, F32)
    cfg = drafter.drafter.config
    assert drafter.kind == "dflash" and cfg.kind == VARIANTS[variant][0] and cfg.target_layers == (1, 3)
    assert drafter.max_draft == (BLOCK if cfg.sample_from_anchor else BLOCK - 1)
    cache = KVCache.for_model(target.model, 64)
    drafter.attach(cache)
    with torch.no_grad():
        for tokens in (PROMPT + [13], PROMPT + [13, 200, 7]):
            committed = len(tokens) - 1
            if cache.length < committed:
                target.model(torch.tensor([tokens[cache.length:committed]]), cache)
            drafter.cache.rollback(min(drafter.cache.length, committed))
            drafter._block(tokens[-1], committed)
            logits, sure, token = [], [], tokens[-1]
            for _ in range(cfg.guesses):
                logits.append(drafter._logits([token]).float())
                sure.append(drafter.confidence)
                if drafter.confidence is not None:  # the early stop reads the round's product of them
                    assert abs(float(drafter.sure) - float(torch.stack(sure).prod())) <= 1e-5
                token = int(logits[-1].argmax())
            drafts = [int(x.argmax()) for x in logits]
            want, confidence = _reference_block(hf_target, model, tokens, drafts)
            for ours, theirs in zip(logits, want):
                kept = theirs > float("-inf")
                error = float((ours[kept] - theirs[kept]).abs().max())
                print(f"{variant} guess against the reference: logits {error:.1e}")
                assert error <= 1e-4 * max(1.0, float(theirs[kept].abs().max()))
                assert int(ours.argmax()) == int(theirs.argmax())
                if not kept.all():
                    assert float(ours[~kept].max()) < float(ours[kept].min())
            if confidence is None:
                assert all(s is None for s in sure)
            else:
                assert float((torch.stack(sure) - confidence).abs().max()) <= 1e-5


@pytest.mark.parametrize("config", [F32, BF16], ids=["f32", "bf16"])
def test_speculation_equals_plain(target_dir, drafter_dir, config):
    """Greedy (adaptive, and fixed k with trees), seeded (with a penalty; and with --draft-p-min 0.5, where DSpark's
    confidence head stops its chains): the output is plain decoding's, and the drafter drafted."""
    _, tdir = target_dir
    _, _, path = drafter_dir
    target = load_model(str(tdir), config, progress=False)
    cases = [(SamplingParams(max_tokens=40, stop_at_eos=False), SpeculationConfig()),
             (SamplingParams(max_tokens=40, stop_at_eos=False), SpeculationConfig(draft_max=4, adaptive=False, tree=3)),
             (SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=40, stop_at_eos=False),
              SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0)),
             (SamplingParams(temperature=0.7, seed=11, max_tokens=40, stop_at_eos=False, repetition_penalty=1.2),
              SpeculationConfig(draft_max=4, adaptive=False, p_min=0.5))]
    for params, spec in cases:
        plain = plain_tokens(target, params)
        ours, final = run(Engine(target, 256, build(target, path, config, spec), spec), params)
        assert ours == plain and final.stats.draft_n > 0


def test_a_resent_prompt_and_a_batch(target_dir, drafter_dir):
    _, tdir = target_dir
    variant, _, path = drafter_dir
    if variant == "dspark-gated":
        pytest.skip("three variants are enough")
    target = load_model(str(tdir), BF16, progress=False)
    assert_resent_and_batched_equal_plain(target, lambda spec: build(target, path, BF16, spec))


def test_sampled_output_has_the_target_distribution(tmp_path):
    """Unseeded at T = 0.7 with chains of 2 drafts from a DSpark drafter over 16 of the target's 24 tokens (its
    Markov bias after each drawn token): the second and third tokens emitted follow the target's two- and three-step
    distributions (chi-square)."""
    from tests.helpers import assert_second_and_third_follow, second_and_third_drawn, two_and_three_step

    hf = tiny_hf_model("qwen3", layers=LAYERS, vocab=24, logit_scale=2)
    tdir = save_hf_dir(hf, tmp_path / "t")
    reference_drafter("dspark", hf, draft_vocab=16).save_pretrained(tmp_path / "d")
    target = load_model(str(tdir), F32, progress=False)
    prompt, V = [1, 2, 3], target.config.vocab_size
    params = SamplingParams(temperature=0.7, max_tokens=4, stop_at_eos=False)
    exact = two_and_three_step(target, prompt, params)
    spec = SpeculationConfig(draft_max=2, adaptive=False, p_min=0.0)
    engine = Engine(target, 16, build(target, tmp_path / "d", F32, spec), spec)
    counts, accepted = second_and_third_drawn(engine, prompt, params, V)
    assert accepted > 0
    assert_second_and_third_follow(counts, exact)


def test_recognised_planned_replayed_exported_and_refused(target_dir, drafter_dir, tmp_path):
    """--draft DIR is the dflash kind; the memory plan counts what the built drafter holds; tune's replay over an
    output made of the target's first token and a round's own drafts keeps them all (DSpark's confidence stopping
    it where the engine would); a tuned DSpark profile exports each engine's DSpark method; a drafter made for
    another target, or reading layers it lacks, is a one-line error naming the mismatch."""
    from quickdraft.api import memory_plan

    hf_target, tdir = target_dir
    variant, _, path = drafter_dir
    assert Draft.parse(str(path)).kind == "dflash"
    target = load_model(str(tdir), F32, progress=False)
    k = BLOCK - 1
    spec = SpeculationConfig(draft_max=k, adaptive=False, p_min=0.0)
    drafter = build(target, path, F32, spec)
    engine = Engine(target, 256, drafter, spec)
    first, _ = run(engine, SamplingParams(max_tokens=1, stop_at_eos=False), PROMPT)
    proposal = drafter.propose(PROMPT + first, lambda source: k, SamplingParams(max_tokens=8), None)
    assert len(proposal.tokens) == k
    assert drafter.offers(PROMPT, first + proposal.tokens, k)[1].kept == k
    from quickdraft.tools import doctor

    assert doctor.tokenizers(target, drafter.drafter).message.startswith("the drafter scores 320 tokens")
    plan = memory_plan(str(tdir), Draft.parse(str(path)), BF16)
    bf16 = load_model(str(tdir), BF16, progress=False)
    built = Engine(bf16, 256, build(bf16, path, BF16), SpeculationConfig()).drafter
    assert next(i.nbytes for i in plan.items if i.what == "draft KV cache") == built.cache_bytes()
    if variant == "dspark":
        _exports(path)
        for change, words in (({"width": 48}, "made for a target of 48 wide"), ({"ids": (2, 8)}, r"layers \[1, 7\]"),
                              ({"ids": (0, 2)}, "id 0")):
            other = tmp_path / "-".join(map(str, change.values()))
            reference_drafter(variant, hf_target, **change).save_pretrained(other)
            with pytest.raises(QuickdraftError, match=words):
                build(target, other, F32)
        config = json.loads((path / "config.json").read_text())
        broken = tmp_path / "no-mask"
        reference_drafter(variant, hf_target).save_pretrained(broken)
        (broken / "config.json").write_text(json.dumps({**config, "mask_token_id": None}))
        with pytest.raises(QuickdraftError, match="lacks 'mask_token_id'"):
            build(target, broken, F32)


def _exports(path) -> None:
    import shlex

    from quickdraft.tools import export

    profile = {"target": "t", "draft": str(path), "draft_kind": "dspark", "draft_max": 4, "predicted_speedup": 1.5,
               "measured_speedup": 1.4}
    for engine in export.ENGINES:
        text = export.export(profile, engine, "/models/t.gguf")
        if engine == "sglang":
            assert "SGLang has no DSpark algorithm" in text and all(line.startswith("#") for line in text.splitlines())
            continue
        (command,) = [line for line in text.splitlines() if not line.startswith("#")]
        argv = shlex.split(command)
        flags = dict(zip(argv[1:], argv[2:]))
        if engine == "llama-server":
            assert flags["--spec-type"] == "draft-dspark" and flags["-md"] == f"{path}.gguf"
        elif engine == "vllm":
            assert json.loads(flags["--speculative-config"])["method"] == "dspark"
