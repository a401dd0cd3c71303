"""The CUDA path on tiny random models: the same guarantees as on the CPU, on the GPU.

scripts/gpu_check.sh runs them on a GPU machine: first the tests marked `kernels` (quick: each kernel and pass against
its reference), then, after the benchmark, the rest (exactness of speculation in every format and family). Without a
CUDA device they are skipped, except in the script's CPU rehearsal (QUICKDRAFT_TEST_DEVICE=cpu, which CI runs):
there the same tests run on the CPU with the CUDA path's bookkeeping (passes of ROW_TILE rows, graphs replayed by a
stand-in capture, under the guard that fails a pass copying from the host or reading back: what a real capture
refuses), so that a broken import, path or argument shows before a GPU is lent.

Speculative output is compared with plain decoding through tests/exactness.py: a mismatch on the GPU writes where,
on which path and by what margin to exact_diff.json. A fixture synchronises CUDA after each test, so that an
asynchronous fault is blamed on the test that caused it.
"""

import os

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.models.transformer import Transformer
from quickdraft.quant import gpu as gpu_kernels
from quickdraft.runtime.graphs import StepGraphs, eager_capture
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.combined import CombinedDrafter
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.weights.loader import load_model as load_anywhere
from tests.helpers import check_second_token_follows_the_target, save_hf_dir, target_and_noisy_draft, tiny_hf_model
from tests.exactness import same_as_plain
from tests.guards import HostTraffic
from tests.helpers import PROMPT, tokens_of

DEVICE = os.environ.get("QUICKDRAFT_TEST_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                                reason="no CUDA device (scripts/gpu_check.sh --device cpu rehearses these on the CPU)")
cuda_only = pytest.mark.skipif(not ON_GPU, reason="CUDA itself is what it checks")
kernels = pytest.mark.kernels  # gpu_check.sh's first phase

CUDA = EngineConfig(device=DEVICE, dtype="bfloat16", weights="bf16", max_context=256)  # bf16: cuBLAS and the graphs


def load_model(path, config=CUDA, progress=False):
    """load_model; in the CPU rehearsal with the CUDA path's bookkeeping as well, so that its code runs."""
    return as_on_cuda(load_anywhere(str(path), config, progress))


def as_on_cuda(lm):
    if not ON_GPU and lm.device.type == "cpu" and isinstance(lm.model, Transformer):
        lm.rows = gpu_kernels.ROW_TILE
        lm.graphs = StepGraphs(lm.model, lm.rows, guarded_capture)
    return lm


TRAFFIC: list[str] = []  # what a guarded capture saw in the test running (the fixture below fails the test on it)


def guarded_capture(fn):
    """The rehearsal's stand-in for a CUDA graph capture (graphs.eager_capture: replay reruns the pass), with the
    host-traffic guard around the capture and its check: a copy from the host in the pass would make a real capture
    fail, a read-back would sync; either is recorded, with the line of quickdraft that made it."""
    calls = []

    def guarded():
        if len(calls) >= 3:  # the warm-up, the capture's check: a real capture records the pass once
            return fn()
        calls.append(1)
        with HostTraffic() as traffic:
            out = fn()
        TRAFFIC.extend(f"{kind} {op} at {where}" for kind, seen in (("copy-in", traffic.copies),
                                                                  ("read-back", traffic.reads)) for op, where in seen)
        return out

    return eager_capture(guarded)


@pytest.fixture(autouse=True)
def _blamed_on_their_own_test():
    """After each test: CUDA synchronised (an asynchronous fault raises here, in the test that launched it, not in
    a later one), and no host traffic in a guarded capture (the rehearsal)."""
    TRAFFIC.clear()
    yield
    if ON_GPU:
        torch.cuda.synchronize()
    assert not TRAFFIC, f"a graphed pass copies from the host or reads back (a CUDA graph capture fails): {TRAFFIC}"


def graphs_on(lm) -> None:
    """A measurement that assumes graphs checks that they ran (a failed capture turns them off with one warning)."""
    assert lm.graphs is None or lm.graphs.disabled is None or "hybrid" in lm.graphs.disabled or \
        "mixture" in lm.graphs.disabled, lm.graphs.disabled


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tuple(as_on_cuda(lm) for lm in target_and_noisy_draft(tmp_path_factory.mktemp("cuda"), CUDA))


@kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_logits_match_the_cpu(tmp_path, arch):
    path = str(save_hf_dir(tiny_hf_model(arch), tmp_path))
    cfg = EngineConfig(device="cpu", dtype="float32", max_context=64)
    cpu = load_anywhere(path, cfg, progress=False)
    gpu = load_model(path, EngineConfig(**{**cfg.__dict__, "device": DEVICE}), progress=False)
    assert gpu.device.type == DEVICE and all(p.device.type == DEVICE for p in gpu.model.parameters())
    tokens = PROMPT[:12]
    with torch.no_grad():
        want = cpu.model(torch.tensor([tokens]), KVCache.for_model(cpu.model))[0]
        cache = KVCache.for_model(gpu.model)  # prefill 4, then one token per step through the cache
        got = [gpu.model(torch.tensor([tokens[:4]], device=DEVICE), cache)[0]]
        got += [gpu.model(torch.tensor([[t]], device=DEVICE), cache)[0] for t in tokens[4:]]
    torch.testing.assert_close(torch.cat(got).cpu(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("spec", [SpeculationConfig(draft_max=3, adaptive=False), SpeculationConfig(draft_max=8)])
def test_cuda_greedy_speculative_equals_plain(models, kind, spec):
    target, draft = models
    model = DraftModelDrafter(draft, target.config.vocab_size, 256)
    drafter = {"draft": model, "ngram": NgramDrafter(), "combined": CombinedDrafter(NgramDrafter(), model)}[kind]
    params = SamplingParams(max_tokens=48, stop_at_eos=False)
    final = same_as_plain(target, Engine(target, 256, drafter, spec), params, PROMPT, label=f"{kind} {spec}")
    assert final.stats.rounds > 0 and final.stats.draft_device in (None, DEVICE, f"{DEVICE}:0")
    graphs_on(target)


def test_cuda_greedy_speculation_into_the_caches_last_positions_equals_plain(models):
    """A generation that runs to the end of its cache: in the last 15 positions a pass no longer fits a graph or a
    padded pass (length + 16 > capacity), so it runs unpadded and eagerly, with other kernels, while the
    verification before it ran as a graph. Greedy speculation must still equal plain decoding there;
    exact_diff.json names each run's path and the top-2 margin where it does not."""
    from tests.exactness import Passes

    target, draft = models
    capacity = 96
    prompt = (PROMPT * 6)[:capacity - 40]
    params = SamplingParams(max_tokens=capacity, stop_at_eos=False)  # capped to the room left: the cache's end
    for drafter in (NgramDrafter(), DraftModelDrafter(draft, target.config.vocab_size, capacity)):
        engine = Engine(target, capacity, drafter, SpeculationConfig(draft_max=8))
        with Passes(target) as passes:
            final = same_as_plain(target, engine, params, prompt, label=f"{drafter.kind} to the cache's end")
        assert final.stats.rounds > 0 and engine.cache.length >= capacity - 1, engine.cache.length
        paths = {p["path"].split(" (")[0] for p in passes.passes}
        assert "unpadded eager" in paths and ("graph" in paths or not ON_GPU and target.graphs is None), paths
    graphs_on(target)


def test_cuda_requests_batched_get_what_each_gets_alone(models):
    """engine.Batch on CUDA (each sequence's rows a pass of the graphs' width): greedy and seeded requests with
    speculation, together, each as alone."""
    from quickdraft.engine import Batch

    target, draft = models
    greedy = SamplingParams(max_tokens=24, stop_at_eos=False)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=24, stop_at_eos=False)
    requests = [dict(prompt=PROMPT[:n], params=p) for n, p in ((20, greedy), (7, seeded), (30, greedy))]

    def engine():
        return Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256),
                      SpeculationConfig(draft_max=4, adaptive=False), slots=3)

    alone = [[e.token for e in engine().generate(**r)] for r in requests]
    together = [[e.token for e in events] for events in Batch(engine(), 3).run(requests)]
    assert together == alone
    graphs_on(target)


def test_cuda_a_conversation_given_up_to_host_memory_comes_back_exactly(models):
    """One slot, two conversations with a draft: the first, cut by the second, is copied to host memory
    (slots.HostCopies) and copied back for its next turn, whose output is what an empty cache gives."""
    from quickdraft.runtime.slots import HostCopies

    target, draft = models
    params = SamplingParams(max_tokens=16, stop_at_eos=False)
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256),
                    SpeculationConfig(draft_max=4, adaptive=False), slots=1, cache_ram=2**30 if ON_GPU else None)
    if not ON_GPU:  # the CPU rehearsal: there cache_ram would keep up to KEPT_MAX sequences (caches fill as they go,
        engine.slots.host = HostCopies(2**30)  # the budget bounds them); on the card Engine gives host copies
    a, b = PROMPT[:10] + [3] * 30, PROMPT[:10] + [4] * 30
    answer = [e.token for e in engine.generate(a, params) if e.token is not None]
    list(engine.generate(b, params))
    again = a + answer + [5, 6]
    final = same_as_plain(target, engine, params, again, label="restored from host memory")
    assert engine.slots.host.restored == 1 and final.timings.cache_n >= len(a)
    graphs_on(target)


def test_cuda_seeded_sampling_equals_plain(models):
    target, draft = models
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40, stop_at_eos=False)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
    final = same_as_plain(target, Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False)),
                          params, PROMPT, label="seeded")
    assert final.stats.rounds > 0


@kernels
def test_cuda_kv_rollback_then_rewrite_equals_straight(models):
    target, _ = models
    m = target.model
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device=DEVICE)
    with torch.no_grad():
        straight = KVCache.for_model(m, 32)
        m(tokens[:, :5], straight)
        want = m(tokens[:, 5:], straight)
        spec = KVCache.for_model(m, 32)
        m(tokens[:, :5], spec)
        m(torch.tensor([[7, 7, 7]], device=DEVICE), spec)
        spec.rollback(5)
        got = m(tokens[:, 5:], spec)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@kernels
def test_cuda_graphs_replay_what_the_eager_passes_compute(models):
    """Loading on CUDA turns graphs on; a prefill, steps and a verification replayed as graphs give the eager
    logits (to bf16 rounding: the graph pads every pass to the same rows), and the check that guards each
    captured graph passed."""
    target, _ = models
    m = target.model
    assert target.graphs is not None
    tokens = torch.tensor([PROMPT], device=DEVICE)
    runs, caches = [], []
    with torch.no_grad():
        for graphs in (target.graphs, None):
            saved, target.graphs = target.graphs, graphs
            try:
                caches.append(KVCache.for_model(m, 128))  # held: a graph lives as long as its cache
                cache, run = caches[-1], target.forward
                runs.append([run(tokens[:, :10], cache), run(tokens[:, 10:11], cache), run(tokens[:, 11:16], cache)])
            finally:
                target.graphs = saved
    assert target.graphs.disabled is None and target.graphs.graphs
    for got, want in zip(*runs):
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "phi3", "gemma2", "gemma3", "gemma4"])
def test_every_family_runs_on_cuda_as_on_the_cpu_and_speculates_exactly(tmp_path, name):
    """bf16 on the GPU: each family's logits as the CPU's in float32 (to bf16 rounding), and greedy speculation
    equal to plain decoding (the graphed, padded passes make every row the same pass)."""
    from tests.families import TOKENS, save, tiny_model

    path = str(save(tiny_model(name), tmp_path / name))
    cpu = load_anywhere(path, EngineConfig(device="cpu", dtype="float32", max_context=256), progress=False)
    gpu = load_model(path)
    with torch.no_grad():
        want = cpu.model(torch.tensor([TOKENS]), KVCache.for_model(cpu.model))[0]
        got = gpu.model(torch.tensor([TOKENS], device=DEVICE), KVCache.for_model(gpu.model))[0].cpu()
    # gemma4's tiny random model is sensitive to bf16 itself: transformers' own bf16 run differs from its float32 run
    # by 0.10 of the largest logit 0.54 (scale-1 attention, per-layer inputs); the others by under 3%
    bound = 0.3 if name == "gemma4" else 5e-2
    assert float((got - want).abs().max()) <= bound * float(want.abs().max())
    params = SamplingParams(max_tokens=32, stop_at_eos=False)
    final = same_as_plain(gpu, Engine(gpu, 256, DraftModelDrafter(gpu, gpu.config.vocab_size, 256),
                                      SpeculationConfig(draft_max=4, adaptive=False)), params, TOKENS, label=name)
    assert final.stats.draft_n_accepted == final.stats.draft_n > 0
    graphs_on(gpu)


# --- the quantized formats on CUDA ------------------------------------------------------------------------------

FORMATS = ("int8", "int4", "mixed")


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, tmp_path_factory):
    fmt = request.param
    config = EngineConfig(device=DEVICE, dtype="bfloat16", max_context=256, weights=fmt)
    pair = target_and_noisy_draft(tmp_path_factory.mktemp(f"cuda-{fmt}"), config)
    return fmt, tuple(as_on_cuda(lm) for lm in pair)


@kernels
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_cuda_quantized_layers_match_their_dequantized_reference(fmt, rows):
    """Each CUDA kernel against x @ (its own dequantized weight), for the row counts a step, a verification, the
    padded pass and a prefill give; and row i alone equal to row i among the others (batch invariance: ours by
    construction up to 32 rows, tinygemm's because a short pass runs as one tile of ROW_TILE rows)."""
    from quickdraft.quant import placement

    torch.manual_seed(0)
    n, k = 384, 896  # the draft's shapes, in small: K with inner tiles of 8 (896 = 7 x 128)
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n) * 0.1
    layer = placement.layer(fmt, w, bias, torch.device(DEVICE))
    assert layer is not None and layer.on_cuda == ON_GPU
    if fmt == "int8" and ON_GPU:
        assert layer.triton, "Triton is on the GPU image: the int8 kernel is ours"
    x = torch.randn(rows, k, device=DEVICE).bfloat16()
    got = layer(x).float()
    want = (x.float() @ layer.dequantized().to(DEVICE).t() + layer.bias.float())
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
    assert float((layer.dequantized().cpu() - w).abs().max()) <= (0.02 if fmt == "int8" else 0.1) * float(w.abs().max())
    if rows <= gpu_kernels.ROW_TILE:
        alone = layer(x[rows - 1:rows].contiguous())
        assert torch.equal(alone[0], layer(x)[rows - 1]), "a row's result depends on the other rows"


@kernels
@cuda_only  # the CPU takes its own path (tests/test_gpu_formats.py)
def test_cuda_loads_gguf_4_bit_blocks_as_they_are(tmp_path):
    """A GGUF file's Q4_0 / Q4_1 layers become int4 layers on the GPU from their own codes: each weight within 1/16
    of a quantization step of the file's value."""
    from gguf import GGMLQuantizationType as T

    from quickdraft.quant import int4
    from quickdraft.weights import gguf as gguf_io
    from quickdraft.quant.blocks import dequantize
    from tests.helpers import write_gguf_from_hf

    types = {"attn_q.weight": T.Q4_0, "attn_k.weight": T.Q4_0, "attn_v.weight": T.Q4_1, "ffn_gate.weight": T.Q4_1,
             "ffn_up.weight": T.Q4_0}
    path = write_gguf_from_hf(tiny_hf_model("qwen2", vocab=512), tmp_path / "m.gguf", table_type=T.Q8_0,
                              layer_types=types)
    lm = load_model(path, EngineConfig(device=DEVICE, dtype="bfloat16", weights="int4", max_context=64))
    layer = lm.model.layers[0].attention.wqkv
    assert isinstance(layer, int4.Int4Linear) and layer.on_cuda == ON_GPU
    raw = {t.name: t for t in gguf_io.open_gguf(path).tensors}
    want = torch.cat([dequantize(raw[f"blk.0.attn_{p}.weight"].data, raw[f"blk.0.attn_{p}.weight"].tensor_type,
                                 tuple(int(n) for n in reversed(raw[f"blk.0.attn_{p}.weight"].shape)), torch.float32)
                      for p in "qkv"])
    groups = want.reshape(want.shape[0], -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (layer.dequantized().cpu() - want).abs().reshape(want.shape[0], -1, 32).amax(-1)
    assert float((err / step.clamp_min(1e-12)).max()) < 1 / 16


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_cuda_quantized_greedy_speculation_equals_plain(quantized, kind):
    fmt, (target, draft) = quantized
    assert target.weights == fmt and target.graphs is not None and target.rows == gpu_kernels.ROW_TILE
    model = DraftModelDrafter(draft, target.config.vocab_size, 256)
    drafter = {"draft": model, "ngram": NgramDrafter()}[kind]
    params = SamplingParams(max_tokens=48, stop_at_eos=False)
    plain = Engine(target, 256)
    for spec in (SpeculationConfig(draft_max=3, adaptive=False), SpeculationConfig(draft_max=8)):
        final = same_as_plain(target, Engine(target, 256, drafter, spec), params, PROMPT, plain,
                              label=f"{fmt} {kind} {spec}")
        assert final.stats.rounds > 0
    assert target.graphs.disabled is None, target.graphs.disabled


def test_cuda_quantized_seeded_sampling_equals_plain(quantized):
    fmt, (target, draft) = quantized
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40, stop_at_eos=False)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
    final = same_as_plain(target, Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False)),
                          params, PROMPT, label=f"{fmt} seeded")
    assert final.stats.rounds > 0, fmt


@kernels
@cuda_only
def test_cuda_refuses_a_plan_that_does_not_fit(tmp_path, monkeypatch):
    """The plan is checked before any weight is read: a card reported 1 MiB free refuses the load with the
    numbers; the loader is never called."""
    import quickdraft
    from quickdraft import api

    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 24 * 2**30))
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(QuickdraftError, match="do not fit on cuda"):
        quickdraft.load(path, "none", device="cuda", context=64)


# --- the 2026 families on CUDA: hybrids (recurrent state), mixture of experts, the built-in MTP drafter -------------

@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_5+mtp"])
def test_cuda_hybrid_and_moe_models_speculate_exactly(tmp_path, name):
    """bf16 on the GPU (the hybrids eagerly: their recurrent state's history is host bookkeeping): logits as the
    CPU's in float32 to bf16 rounding, greedy speculation with a noisy copy as draft (or the model's MTP layers)
    equal to plain decoding, and seeded sampling likewise."""
    from tests.helpers import add_noise
    from tests.test_hybrid import tiny_qwen35, with_mtp
    from tests.test_moe import tiny_moe

    def build(noise=0.0):
        model = tiny_qwen35(logit_scale=20) if name.startswith("qwen3_5") and "moe" not in name else \
            tiny_moe(name, logit_scale=20)
        return add_noise(model, noise) if noise else model

    path = (with_mtp(build(), tmp_path / "t") if name.endswith("+mtp") else save_hf_dir(build(), tmp_path / "t"))
    cpu = load_anywhere(str(path), EngineConfig(device="cpu", dtype="float32", max_context=256), progress=False)
    gpu = load_model(path)
    with torch.no_grad():
        want = cpu.model(torch.tensor([PROMPT]), KVCache.for_model(cpu.model))[0]
        got = gpu.model(torch.tensor([PROMPT], device=DEVICE), KVCache.for_model(gpu.model))[0].cpu()
    # bf16 against float32 with peaked logits (the head scaled by 20): the CPU's own bf16 run is 8% off on qwen3_5;
    # a random router's top-k flips under bf16 rounding (other experts, other logits): MoE is checked by exactness
    if "moe" not in name:
        assert float((got - want).abs().max()) <= 0.15 * float(want.abs().max())
    if name.endswith("+mtp"):
        from quickdraft.speculative.mtp import MtpDrafter

        drafter = MtpDrafter(gpu, 256)
    else:
        drafter = DraftModelDrafter(load_model(save_hf_dir(build(0.15), tmp_path / "d")), gpu.config.vocab_size, 256)
    spec = SpeculationConfig(draft_max=4, adaptive=False)
    for params in (SamplingParams(max_tokens=32, stop_at_eos=False),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=32, stop_at_eos=False)):
        final = same_as_plain(gpu, Engine(gpu, 256, drafter, spec), params, PROMPT, label=f"{name} {params}")
        assert final.stats.rounds > 0, (name, params)


def test_cuda_gemma4_assistant_speculates_exactly(tmp_path):
    """Gemma 4's assistant on the GPU, reading the target's keys and values there: its step as the CPU's in float32
    to bf16 rounding, greedy and seeded speculation equal to plain decoding."""
    from quickdraft.speculative.draft import Draft, DraftBuilder
    from tests.families import save, tiny_model
    from tests.test_assistant import tiny_assistant

    hf = tiny_model("gemma4")
    target_dir = save(hf, tmp_path / "t")
    tiny_assistant(hf.config, True).save_pretrained(tmp_path / "a")
    gpu = load_model(target_dir)
    spec = SpeculationConfig(draft_max=3, adaptive=False, p_min=0.0)
    drafter = DraftBuilder(gpu, CUDA, 256).drafter(Draft.parse(str(tmp_path / "a")), spec)
    assert drafter.device.type == DEVICE
    for params in (SamplingParams(max_tokens=32, stop_at_eos=False),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=32, stop_at_eos=False)):
        final = same_as_plain(gpu, Engine(gpu, 256, drafter, spec), params, PROMPT, label=f"assistant {params}")
        assert final.stats.draft_n > 0, params


def random_head(path, kind: str, seed: int = 2):
    """A random EAGLE-3 head or DSpark drafter in vLLM's speculators format for tiny_hf_model("qwen3", layers=6),
    written by hand (the GPU machine has no speculators library: tests/test_eagle3.py and test_dspark.py check these
    layouts against it): qwen3 layers over 200 of the target's 320 tokens (d2t)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    dim, V, Vd = 64, 320, 200

    def w(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    layers = 1 if kind == "eagle3" else 2
    tl = {"model_type": "qwen3", "vocab_size": V, "hidden_size": dim, "intermediate_size": 80,
          "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rope_theta": 1e6, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    kept = sorted(torch.randperm(V, generator=g)[:Vd].tolist())
    t = {"lm_head.weight": w(Vd, dim), "norm.weight": 1 + w(dim), "d2t": torch.tensor(kept) - torch.arange(Vd)}
    width = 2 * dim if kind == "eagle3" else dim
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(64, width), p + "self_attn.k_proj.weight": w(32, width),
              p + "self_attn.v_proj.weight": w(32, width), p + "self_attn.o_proj.weight": w(dim, 64),
              p + "self_attn.q_norm.weight": 1 + w(16), p + "self_attn.k_norm.weight": 1 + w(16),
              p + "mlp.gate_proj.weight": w(80, dim), p + "mlp.up_proj.weight": w(80, dim),
              p + "mlp.down_proj.weight": w(dim, 80), p + "input_layernorm.weight": 1 + w(dim),
              p + "post_attention_layernorm.weight": 1 + w(dim)}
    if kind == "eagle3":
        t |= {"fc.weight": w(dim, 3 * dim), "layers.0.hidden_norm.weight": 1 + w(dim), "embed_tokens.weight": w(V, dim)}
        config = {"speculators_model_type": "eagle3", "draft_vocab_size": Vd,
                  "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "transformer_layer_config": tl}
    else:
        t |= {"fc.weight": w(dim, 2 * dim), "hidden_norm.weight": 1 + w(dim), "markov_head.markov_w1.weight": w(V, 8),
              "markov_head.markov_w2.weight": w(Vd, 8), "confidence_head.proj.weight": w(1, dim + 8),
              "confidence_head.proj.bias": w(1)}
        config = {"speculators_model_type": "dspark", "draft_vocab_size": Vd, "aux_hidden_state_layer_ids": [2, 4],
                  "mask_token_id": V - 1, "block_size": 5, "markov_rank": 8, "transformer_layer_config": tl}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_cuda_speculators_heads_speculate_exactly(tmp_path, kind):
    """An EAGLE-3 head and a DSpark drafter (vLLM's speculators format) on the GPU, reading the target's layer states
    its graphed passes keep: greedy and seeded speculation (DSpark's confidence stopping its chains) equal plain
    decoding."""
    from quickdraft.speculative.draft import Draft, DraftBuilder

    hf = tiny_hf_model("qwen3", layers=6, logit_scale=4)
    gpu = load_model(save_hf_dir(hf, tmp_path / "t"))
    head = random_head(tmp_path / kind, kind)
    for spec in (SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0), SpeculationConfig(p_min=0.3)):
        drafter = DraftBuilder(gpu, CUDA, 256).drafter(Draft.parse(str(head)), spec)
        assert drafter.device.type == DEVICE and drafter.kind == ("eagle3" if kind == "eagle3" else "dflash")
        for params in (SamplingParams(max_tokens=32, stop_at_eos=False),
                       SamplingParams(temperature=0.9, seed=3, max_tokens=32, stop_at_eos=False)):
            final = same_as_plain(gpu, Engine(gpu, 256, drafter, spec), params, PROMPT, label=f"{kind} {params}")
            assert final.stats.draft_n > 0, (spec, params)


def test_cuda_dflash_drafter_speculates_exactly(tmp_path):
    """A DFlash drafter on the GPU, reading the target's hidden states that its graphed passes keep (written at the
    pass's positions): those are an eager pass's to bf16 rounding, greedy and seeded speculation equal plain
    decoding, and trees stay off (a CUDA pass's shape decides its arithmetic)."""
    from quickdraft.speculative.draft import Draft, DraftBuilder
    from tests.test_dflash import reference_drafter

    hf = tiny_hf_model("qwen3", layers=6, logit_scale=4)
    target_dir = save_hf_dir(hf, tmp_path / "t")
    reference_drafter("dflash", hf.config).save_pretrained(tmp_path / "d")
    gpu = load_model(target_dir)
    spec = SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0, tree=3)
    drafter = DraftBuilder(gpu, CUDA, 256).drafter(Draft.parse(str(tmp_path / "d")), spec)
    assert drafter.device.type == DEVICE and not gpu.trees
    for params in (SamplingParams(max_tokens=32, stop_at_eos=False),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=32, stop_at_eos=False)):
        engine = Engine(gpu, 256, drafter, spec)
        final = same_as_plain(gpu, engine, params, PROMPT, label=f"dflash {params}")
        assert final.stats.draft_n > 0 and final.stats.tree_rounds == 0, params
    graphs_on(gpu)
    n = engine.cache.length  # the positions the last generation's passes ran: its prompt and output
    kept = engine.cache.features[:n].float()
    eager = KVCache.for_model(gpu.model, 256)
    eager.keep_features(list(drafter.drafter.config.target_layers), gpu.config.dim)
    with torch.inference_mode():
        gpu.model(torch.tensor([engine.last.tokens[:n]], device=gpu.device), eager)
    want = eager.features[:n].float()
    assert float((kept - want).abs().max()) <= 0.05 * float(want.abs().max())


def test_cuda_hybrid_from_llama_cpps_gguf_speculates_exactly(tmp_path):
    """qwen3.5 with its MTP block, converted by llama.cpp to q8_0 (tiled value heads, nextn tensors), on the GPU in
    int8 and int4: greedy speculation with the MTP layers and with n-gram lookup equal to plain decoding."""
    from quickdraft.speculative.mtp import MtpDrafter
    from tests import llamacpp

    path = llamacpp.reference("qwen3_5-mtp", "q8_0", tmp_path)
    params = SamplingParams(max_tokens=32, stop_at_eos=False)
    for fmt in ("int8", "int4"):
        gpu = load_model(path, EngineConfig(device=DEVICE, dtype="bfloat16", weights=fmt, max_context=256))
        plain, _ = tokens_of(Engine(gpu, 256), params)
        spec = SpeculationConfig(draft_max=4, adaptive=False)
        for drafter in (MtpDrafter(gpu, 256), NgramDrafter()):
            same_as_plain(gpu, Engine(gpu, 256, drafter, spec), params, PROMPT + plain + PROMPT,
                          label=f"{fmt} {drafter.kind}")


@cuda_only
def test_a_draft_on_the_cpu_samples_with_a_generator_of_its_own(models, tmp_path):
    """--draft-device cpu beside a target on the GPU, sampling unseeded: the draft draws with a CPU generator
    (torch.multinomial refuses the target's), and seeded output still equals plain decoding."""
    target, _ = models
    draft = load_model(save_hf_dir(tiny_hf_model("qwen2", seed=0, logit_scale=20), tmp_path / "d"),
                       EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256))
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
    engine = Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False))
    _, final = tokens_of(engine, SamplingParams(temperature=0.9, max_tokens=24, stop_at_eos=False))
    assert final.stats.rounds > 0 and final.stats.draft_device == "cpu"
    seeded = SamplingParams(temperature=0.9, seed=4, max_tokens=24, stop_at_eos=False)
    assert tokens_of(engine, seeded)[0] == tokens_of(Engine(target, 256), seeded)[0]


@cuda_only
def test_a_graphed_pass_does_not_synchronise(tmp_path):
    """PyTorch's sync debug mode raises at any synchronising call: a graphed step and verification of a model whose
    token table is in Q6_K blocks (as the default target's) run without one once captured (tests/test_gpu_paths.py
    checks the same on the CPU with a guard)."""
    from gguf import GGMLQuantizationType as T

    from tests.helpers import write_gguf_from_hf

    model = tiny_hf_model("qwen2", vocab=512, hidden_size=256, intermediate_size=256)
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", table_type=T.Q6_K)
    lm = load_model(path, EngineConfig(device="cuda", dtype="bfloat16", weights="mixed", max_context=128))
    cache = KVCache.for_model(lm.model, 128)
    tokens = torch.tensor([PROMPT], device="cuda")
    with torch.inference_mode():
        lm.forward(tokens[:, :4], cache)  # captures (a capture synchronises)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lm.forward(tokens[:, 4:5], cache)
            lm.forward(tokens[:, 5:10], cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    graphs_on(lm)
    assert lm.graphs.graphs


# --- the statistical tests last: the longest, and a law the CPU suite already checks on the CPU's kernels ---------

def test_cuda_sampled_output_follows_the_target(tmp_path):
    """Unseeded rejection sampling on the GPU: the first token a round emits is distributed as the target says."""
    V, draws = 8, 800 if ON_GPU else 200  # the rehearsal checks the path, the GPU the law
    target = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=1, vocab=V, logit_scale=8), tmp_path / "t")),
                        CUDA, False)
    draft = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=2, vocab=V, logit_scale=8), tmp_path / "d")),
                       CUDA, False)
    check_second_token_follows_the_target(target, draft, draws)


def test_cuda_int4_sampled_output_follows_the_target(tmp_path):
    """The chi-square test of rejection sampling, with both models in int4 on the GPU."""
    V, draws = 8, 600 if ON_GPU else 200
    cfg = EngineConfig(device=DEVICE, dtype="bfloat16", max_context=256, weights="int4")
    target = load_model(save_hf_dir(tiny_hf_model("llama", seed=1, vocab=V, logit_scale=8), tmp_path / "t"), cfg)
    draft = load_model(save_hf_dir(tiny_hf_model("llama", seed=2, vocab=V, logit_scale=8), tmp_path / "d"), cfg)
    assert target.plan["linear"], target.plan
    check_second_token_follows_the_target(target, draft, draws)
