"""Hybrid models (qwen3.5: Gated DeltaNet linear-attention layers between gated full-attention layers), on tiny random
configurations: logits against HF transformers' own implementation, and speculation over the recurrent state as exact
as over a KV cache (greedy and seeded output equal to plain decoding, the state after rounds of accepts and rejections
bit for bit plain decoding's, the sampled distribution the target's)."""

from pathlib import Path

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime.kv_cache import HISTORY, KVCache
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.weights.loader import load_model
from tests.helpers import PROMPT, add_noise, check_second_token_follows_the_target, save_hf_dir, tokens_of as run

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=512)
BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)


def tiny_qwen35(seed: int = 0, vocab: int = 320, layers: int = 4, logit_scale: float = 1.0, v_heads: int = 4):
    """A random Qwen3.5 text model: layers 0-2 Gated DeltaNet (2 key heads, v_heads value heads), layer 3 gated full
    attention, partial rotary; its norms and biases randomised so that every parameter matters."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=v_heads,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # zero-centred norms (1 + w) except the linear layers' gated norm
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    model = tiny_qwen35()
    path = save_hf_dir(model, tmp_path_factory.mktemp("qwen35"))
    return model, load_model(str(path), F32, progress=False)


def test_the_config_is_read_as_transformers_builds_the_model(hf_and_ours):
    _, ours = hf_and_ours
    cfg = ours.config
    assert cfg.arch == "qwen3_5" and cfg.layer_types == ("linear", "linear", "linear", "full")
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.rope.rotary_dim == 8  # partial rotary 0.25 of 32
    assert (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim) == (2, 4, 16, 16)
    assert ours.model.hybrid and ours.graphs is None


@pytest.mark.parametrize("length", [12, 150])  # 150: the chunked form (prefills of more than 64 tokens)
def test_prefill_logits_equal_transformers(hf_and_ours, length):
    hf, ours = hf_and_ours
    tokens = torch.randint(0, 320, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        want = hf(tokens).logits[0]
        got = ours.model(tokens, KVCache.for_model(ours.model))[0]
    err = float((got - want).abs().max())
    print(f"max |logit difference| against transformers, prefill of {length}: {err:.2e}")
    assert err <= 1e-5 * max(1.0, float(want.abs().max()))


def test_step_by_step_and_rolled_back_passes_equal_transformers(hf_and_ours):
    """A prefill, steps through the cache, then a verification-sized pass rolled back into its middle and the rest:
    the logits of every position as transformers' one pass over them all."""
    hf, ours = hf_and_ours
    tokens = torch.randint(0, 320, (1, 120), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(tokens).logits[0]
        cache = KVCache.for_model(ours.model)
        got = [ours.model(tokens[:, :70], cache)[0]]
        got += [ours.model(tokens[:, i:i + 1], cache)[0] for i in range(70, 80)]
        verified = ours.model(tokens[:, 80:89], cache)[0]  # 9 positions, 4 of them kept
        cache.rollback(84)
        got += [verified[:4], ours.model(tokens[:, 84:120], cache)[0]]
    err = float((torch.cat(got) - want).abs().max())
    print(f"max |logit difference| against transformers, cached steps and a rollback: {err:.2e}")
    assert err <= 1e-5 * max(1.0, float(want.abs().max()))


def test_a_rollback_beyond_the_kept_states_is_a_clear_error(hf_and_ours):
    _, ours = hf_and_ours
    cache = KVCache.for_model(ours.model)
    with torch.no_grad():
        ours.model(torch.arange(10)[None], cache)
        for t in range(HISTORY + 2):
            ours.model(torch.tensor([[t]]), cache)
    with pytest.raises(ValueError, match="keeps the last 17 positions"):
        cache.rollback(10)


def test_attention_only_models_keep_no_recurrent_state(bf16_pair):
    target, _ = bf16_pair
    cache = KVCache.for_model(target.model)
    assert cache.states == [] and cache.recurrent == [] and target.model.state_layout() is None


# --- speculation over the recurrent state -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A hybrid target and a noisy copy of it as its draft (same vocabulary, agreeing often, not always), bf16."""
    root = tmp_path_factory.mktemp("hybrid-pair")
    target = load_model(str(save_hf_dir(tiny_qwen35(logit_scale=20), root / "t")), BF16, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_qwen35(logit_scale=20), 0.15), root / "d")), BF16, False)
    return target, draft


def states_of(cache: KVCache, length: int):
    """Everything a cache holds for positions 0..length - 1: keys and values, and the recurrent states."""
    kv = [t[:, :, :length].clone() for t in cache.tensors()]
    return kv + [t.clone() for s in cache.recurrent for t in (s.conv, s.ssm)]


SPECS = [SpeculationConfig(draft_max=1, adaptive=False), SpeculationConfig(draft_max=4, adaptive=False),
         SpeculationConfig(draft_max=8)]


@pytest.mark.parametrize("kind", ["draft", "ngram"])
@pytest.mark.parametrize("spec", SPECS, ids=["fixed-1", "fixed-4", "adaptive"])
def test_greedy_speculative_equals_plain_and_leaves_the_same_state(pair, kind, spec):
    target, draft = pair
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain_engine = Engine(target, 256)
    prompt = PROMPT
    if kind == "ngram":  # the prompt holds the continuation of its own start, so lookup has matches
        prompt = PROMPT + run(plain_engine, params)[0] + PROMPT
    plain, _ = run(plain_engine, params, prompt)
    plain_state = states_of(plain_engine.cache, plain_engine.cache.length)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256) if kind == "draft" else NgramDrafter()
    engine = Engine(target, 256, drafter, spec)
    ours, final = run(engine, params, prompt)
    assert ours == plain
    stats = final.stats
    assert stats.rounds > 0 and stats.draft_n > 0
    assert 0 < stats.draft_n_accepted < stats.draft_n or spec.draft_max == 1  # rejections: rollbacks into a pass
    # the same positions processed: the last token is not fed to the target in either run
    assert engine.cache.length == plain_engine.cache.length
    for a, b in zip(states_of(engine.cache, engine.cache.length), plain_state, strict=True):
        assert torch.equal(a, b), "the state after speculative rounds differs from plain decoding's"


def test_seeded_sampling_with_speculation_equals_without(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
    ours, final = run(Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False)), params)
    assert ours == plain and final.stats.rounds > 0


def test_sampled_output_follows_the_target(tmp_path):
    """Unseeded rejection sampling on a hybrid pair: the first token a round emits (after the target's first) is
    distributed as the target says (the exact two-step distribution through the recurrent state)."""
    V, draws = 8, 800
    target = load_model(str(save_hf_dir(tiny_qwen35(seed=1, vocab=V, logit_scale=8), tmp_path / "t")), BF16, False)
    draft = load_model(str(save_hf_dir(tiny_qwen35(seed=2, vocab=V, logit_scale=8), tmp_path / "d")), BF16, False)
    check_second_token_follows_the_target(target, draft, draws)


def test_a_hybrid_loads_from_a_multimodal_checkpoints_names(tmp_path):
    """Qwen3.5 checkpoints are multimodal (Qwen3_5ForConditionalGeneration): the text model's tensors under
    model.language_model., a vision tower and MTP layers beside them, the text config under text_config."""
    import json

    from safetensors.torch import load_file, save_file

    model = tiny_qwen35()
    text = save_hf_dir(model, tmp_path / "text")
    tensors = load_file(str(next(Path(text).glob("*.safetensors"))))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(64, 128)
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    save_file(renamed, str(wrapped / "model.safetensors"))
    config = json.loads((Path(text) / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": config,
                                                    "tie_word_embeddings": False}))
    for f in Path(text).glob("tokenizer*"):
        (wrapped / f.name).write_bytes(f.read_bytes())
    a = load_model(str(text), F32, progress=False)
    b = load_model(str(wrapped), F32, progress=False)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(a.model(tokens, KVCache.for_model(a.model)), b.model(tokens, KVCache.for_model(b.model)))


def test_the_fused_recurrence_kernel_computes_the_reference_recurrence(pair):
    """quickdraft's gated_delta_step (one C++ call per token, where the CPU kernels run) against the PyTorch
    recurrence it replaces: the same logits to float32 rounding, over a prefill, steps and a verification pass."""
    from quickdraft.quant import vnni

    if not vnni.available():
        pytest.skip(f"quickdraft's CPU kernels are off here: {vnni.unavailable_reason()}")
    target, _ = pair
    layers = [b.attention for b in target.model.layers if b.attention.kind == "linear"]
    assert all(a.fused_step for a in layers)
    tokens = torch.tensor([PROMPT * 3])
    runs = []
    for fused in (True, False):
        for a in layers:
            a.fused_step = fused
        cache = KVCache.for_model(target.model, 128)
        with torch.no_grad():
            out = [target.model(tokens[:, :20], cache)] + [target.model(tokens[:, i:i + 1], cache) for i in range(20, 30)]
            out.append(target.model(tokens[:, 30:38], cache))
        runs.append(torch.cat([o[0] for o in out]))
    for a in layers:
        a.fused_step = True
    assert float((runs[0] - runs[1]).abs().max()) <= 2e-2 * float(runs[1].abs().max())


def test_the_memory_plan_counts_the_recurrent_states(pair):
    from quickdraft.weights import memory

    target, _ = pair
    cache = KVCache.for_model(target.model, 256)
    assert memory.kv_bytes(target.config, 256) == cache.nbytes()
    assert cache.recurrent[0].slots.shape[0] == HISTORY + 2


# --- the target's own MTP layers as the drafter -----------------------------------------------------------------

def with_mtp(model, directory: Path, seed: int = 3) -> Path:
    """Save a tiny qwen3.5 model with an MTP block (random weights, as checkpoints name them: mtp.fc,
    mtp.pre_fc_norm_*, mtp.layers.0.* a full-attention decoder layer, mtp.norm); transformers does not build it, so
    its tensors are written beside the model's."""
    import json

    from safetensors.torch import load_file, save_file

    save_hf_dir(model, directory)
    file = next(directory.glob("*.safetensors"))
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(seed)
    dim = model.config.hidden_size
    full = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    for name, t in list(tensors.items()):  # the layer's shapes, fresh random values
        prefix = f"model.layers.{full}."
        if name.startswith(prefix):
            value = 0.1 * torch.randn(t.shape, generator=g) if "norm" in name else 0.05 * torch.randn(t.shape, generator=g)
            tensors["mtp.layers.0." + name.removeprefix(prefix)] = value
    tensors["mtp.fc.weight"] = 0.05 * torch.randn(dim, 2 * dim, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(dim, generator=g)
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return directory


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    path = with_mtp(tiny_qwen35(logit_scale=20), tmp_path_factory.mktemp("mtp"))
    return load_model(str(path), BF16, False)


def mtp_drafter(target, spec, ngram=False):
    from quickdraft.speculative.draft import Draft, DraftBuilder

    builder = DraftBuilder(target, BF16, 256)
    return builder.drafter(Draft.parse({False: "mtp", True: "ngram+mtp"}.get(ngram, ngram)), spec)


@pytest.mark.parametrize("ngram", [False, True, "mtp,ngram"], ids=["mtp", "ngram+mtp", "mtp,ngram"])
@pytest.mark.parametrize("spec", SPECS, ids=["fixed-1", "fixed-4", "adaptive"])
def test_mtp_greedy_speculative_equals_plain(mtp_target, spec, ngram):
    target = mtp_target
    assert target.model.mtp is not None
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    engine = Engine(target, 256, mtp_drafter(target, spec, ngram), spec)
    ours, final = run(engine, params)
    assert ours == plain
    assert final.stats.rounds > 0 and final.stats.draft_n > 0 and "mtp" in final.stats.sources


def test_the_mtp_tree_replay_matches_the_engine(mtp_target):
    """tune's replay of the MTP layers' rounds as trees (--draft-tree 3; their chain past its first wrong guess says
    where the candidates go) runs the rounds the engine runs on the hybrid target."""
    from quickdraft.tools.tune import Costs, reference, simulate

    k, n = 3, 48
    outputs, _ = reference(mtp_target, {"p": PROMPT}, n)
    spec = SpeculationConfig(draft_max=k, adaptive=False, p_min=0.0, tree=3)
    events = list(Engine(mtp_target, 256, mtp_drafter(mtp_target, spec), spec).generate(
        PROMPT, SamplingParams(max_tokens=n, stop_at_eos=False)))
    assert [e.token for e in events if e.token is not None] == outputs["p"]
    stats = events[-1].stats
    replayed = mtp_drafter(mtp_target, spec)
    costs = Costs(1.0, {i: 1.0 for i in range(1, k + 1)}, 0.0, 0.0, {3: {i: 1.0 for i in range(1, k + 1)}})
    sim = simulate(replayed.offers(PROMPT, outputs["p"], k), k, costs, replayed.replay_round, width=3)
    assert stats.tree_rounds >= 3 and stats.draft_n_accepted > 0
    assert (sim["rounds"], sim["plain"], sim["trees"], sim["alternatives"]) == \
        (stats.rounds, stats.plain_steps, stats.tree_rounds, stats.tree_alternatives_kept)


def test_the_memory_plan_counts_what_the_mtp_drafter_holds(mtp_target):
    """The plan made before loading (the drafter's kind states its caches) against the caches the built drafter
    holds after a generation: the MTP layer's keys and values and the target's hidden states."""
    from quickdraft.api import memory_plan
    from quickdraft.speculative.draft import Draft

    spec = SpeculationConfig(draft_max=3, adaptive=False)
    engine = Engine(mtp_target, 256, mtp_drafter(mtp_target, spec), spec)
    run(engine, SamplingParams(max_tokens=10, stop_at_eos=False))
    plan = memory_plan(mtp_target.name, Draft.parse("mtp"), BF16)
    assert [i.what for i in plan.items] == ["target weights", "target KV cache", "draft KV cache", "activations"]
    assert next(i.nbytes for i in plan.items if i.what == "draft KV cache") == engine.drafter.cache_bytes() > 0


def test_doctors_sampler_check_runs_the_mtp_drafter_after_the_targets_pass(mtp_target):
    """doctor's sampler check proposes from the MTP block, which reads the target's hidden states: it runs the
    target's pass first (it failed on an empty pair list before)."""
    from quickdraft.tools import doctor

    spec = SpeculationConfig(draft_max=3, adaptive=False)
    drafter = mtp_drafter(mtp_target, spec)
    finding = doctor.sampler(drafter, 320, Engine(mtp_target, 256, drafter, spec))
    assert finding.level == "ok" and 1 <= len(finding.figures["candidates_per_position"]) <= 3


def test_mtp_seeded_sampling_equals_plain(mtp_target):
    spec = SpeculationConfig(draft_max=3, adaptive=False)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(mtp_target, 256), params)
    ours, final = run(Engine(mtp_target, 256, mtp_drafter(mtp_target, spec), spec), params)
    assert ours == plain and final.stats.rounds > 0


def test_mtp_drafts_from_the_targets_hidden_state_and_the_pending_token(mtp_target):
    """The wiring: the engine's cache holds each position's final (normed) hidden state as a fresh pass computes
    it, and a round's first draft is the MTP block's guess from (the hidden state of the last position the target
    ran, the token it chose there), computed here by hand from the block's parts."""
    target = mtp_target
    model, spec = target.model, SpeculationConfig(draft_max=1, adaptive=False)
    engine = Engine(target, 256, mtp_drafter(target, spec), spec)
    params = SamplingParams(max_tokens=1, stop_at_eos=False)
    first, _ = run(engine, params)
    seq = PROMPT + first
    with torch.no_grad():
        fresh = KVCache.for_model(model, 64)
        fresh.keep_hidden(target.config.dim)
        model(torch.tensor([PROMPT]), fresh)
        assert torch.equal(engine.cache.hidden[:len(PROMPT)], fresh.hidden[:len(PROMPT)])
        h = fresh.hidden[len(PROMPT) - 1][None, None]  # the position that chose `first`
        m = model.mtp
        e = model.tok_embeddings(torch.tensor([[seq[-1]]]))
        x = m.fc(torch.cat([m.enorm(e), m.hnorm(h)], -1))
        # one position, nothing before it in the block's own cache but the prompt's pairs: run the same layer over
        # all pairs to get its attention right, then take the last
        pairs_h = fresh.hidden[:len(PROMPT)][None]
        pairs_e = model.tok_embeddings(torch.tensor([seq[1:]]))
        xs = m.fc(torch.cat([m.enorm(pairs_e), m.hnorm(pairs_h)], -1))
        assert torch.equal(xs[:, -1:], x)
        cache = KVCache(m.kv_layout(), 64, dtype=model.dtype)
        cos, sin = (t[1:len(PROMPT) + 1] for t in model._tables("full"))
        out = m.layer(xs, cos, sin, cache, 0, None)
        want = int(model.head(m.norm(out))[0, -1].argmax())
    drafter = engine.drafter
    drafter.begin(seq[:-1])
    proposal = drafter.propose(seq, lambda source: 1, SamplingParams(), torch.Generator())
    assert proposal.tokens == [want] and proposal.source == "mtp"


def test_mtp_is_a_clear_error_for_a_target_without_mtp_layers(pair):
    from quickdraft.errors import QuickdraftError

    target, _ = pair
    with pytest.raises(QuickdraftError, match="has no multi-token-prediction layers"):
        mtp_drafter(target, SpeculationConfig())


def test_a_config_declaring_mtp_layers_its_file_lacks_loads_without_them(tmp_path):
    """transformers re-saves Qwen3.5 without the MTP tensors but keeps mtp_num_hidden_layers: the model loads, and
    --draft mtp says why it cannot run."""
    import json

    from quickdraft.errors import QuickdraftError

    path = save_hf_dir(tiny_qwen35(), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    target = load_model(str(path), BF16, False)
    assert target.model.mtp is None
    with pytest.raises(QuickdraftError, match="has no multi-token-prediction layers"):
        mtp_drafter(target, SpeculationConfig())


def test_hybrid_rounds_draft_at_most_what_the_state_can_roll_back(pair):
    """--draft-max 32 on a hybrid: rounds draft at most HISTORY - 1 tokens (a rollback past the kept states would
    fail), and the output is still plain decoding's."""
    target, draft = pair
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    spec = SpeculationConfig(draft_max=32, adaptive=False)
    engine = Engine(target, 256, NgramDrafter(), spec)
    assert engine.max_draft == HISTORY - 1
    prompt = PROMPT + plain + PROMPT
    ours, final = run(engine, params, prompt)
    assert ours == run(Engine(target, 256), params, prompt)[0] and final.stats.rounds > 0
    assert 0 < max(final.stats.k_history) <= HISTORY - 1


@pytest.mark.parametrize("v_heads", [4, 16])
def test_a_verification_pass_gives_each_position_a_plain_steps_logits(tmp_path, v_heads):
    """Bit for bit, in bf16 on the CPU kernels: 9 positions in one pass against the same 9 one step at a time.
    16 value heads: PyTorch's vectorised sigmoid/softplus/exp round a value in a tensor's scalar tail differently,
    so the gates are computed per token (a third of rows differed when they were computed over the pass)."""
    target = load_model(str(save_hf_dir(tiny_qwen35(v_heads=v_heads), tmp_path)), BF16, False)
    tokens = torch.tensor([PROMPT[:14]])
    with torch.no_grad():
        a = KVCache.for_model(target.model, 64)
        target.model(tokens[:, :5], a)
        together = target.model(tokens[:, 5:14], a)[0]
        b = KVCache.for_model(target.model, 64)
        target.model(tokens[:, :5], b)
        alone = torch.cat([target.model(tokens[:, i:i + 1], b)[0] for i in range(5, 14)])
    assert torch.equal(together, alone)
    assert all(torch.equal(x.ssm, y.ssm) for x, y in zip(a.recurrent, b.recurrent))
