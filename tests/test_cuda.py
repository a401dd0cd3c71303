"""The CUDA path on tiny random models: the same guarantees as on the CPU, on the GPU.

Skipped without a CUDA device (CI has none); scripts/gpu_check.sh runs them on a GPU machine.
"""

import pytest
import torch

from quickdraft import sampling
from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.combined import CombinedDrafter
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.verify import chi_square
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, target_and_noisy_draft, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = EngineConfig(device="cuda", dtype="bfloat16", max_context=256)
PROMPT = [5, 17, 250, 3, 99, 42, 7, 5, 17, 250, 3, 11, 64, 128, 5, 17]


def tokens_of(engine, params, prompt=PROMPT):
    events = list(engine.generate(prompt, params))
    return [e.token for e in events if e.token is not None], events[-1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_noisy_draft(tmp_path_factory.mktemp("cuda"), CUDA)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_logits_match_the_cpu(tmp_path, arch):
    path = str(save_hf_dir(tiny_hf_model(arch), tmp_path))
    cfg = EngineConfig(device="cpu", dtype="float32", max_context=64)
    cpu = load_model(path, cfg, progress=False)
    gpu = load_model(path, EngineConfig(**{**cfg.__dict__, "device": "cuda"}), progress=False)
    assert gpu.device.type == "cuda" and all(p.device.type == "cuda" for p in gpu.model.parameters())
    tokens = PROMPT[:12]
    with torch.no_grad():
        want = cpu.model(torch.tensor([tokens]), KVCache.for_model(cpu.model))[0]
        cache = KVCache.for_model(gpu.model)  # prefill 4, then one token per step through the cache
        got = [gpu.model(torch.tensor([tokens[:4]], device="cuda"), cache)[0]]
        got += [gpu.model(torch.tensor([[t]], device="cuda"), cache)[0] for t in tokens[4:]]
    torch.testing.assert_close(torch.cat(got).cpu(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("spec", [SpeculationConfig(draft_max=3, adaptive=False), SpeculationConfig(draft_max=8)])
def test_cuda_greedy_speculative_equals_plain(models, kind, spec):
    target, draft = models
    model = DraftModelDrafter(draft, target.config.vocab_size, 256)
    drafter = {"draft": model, "ngram": NgramDrafter(), "combined": CombinedDrafter(NgramDrafter(), model)}[kind]
    params = SamplingParams(max_tokens=48, stop_at_eos=False)
    plain, _ = tokens_of(Engine(target, 256), params)
    ours, final = tokens_of(Engine(target, 256, drafter, spec, kind), params)
    assert ours == plain
    assert final.stats.rounds > 0 and final.stats.draft_device in (None, "cuda", "cuda:0")


def test_cuda_seeded_sampling_equals_plain(models):
    target, draft = models
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=40, stop_at_eos=False)
    plain, _ = tokens_of(Engine(target, 256), params)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
    ours, final = tokens_of(Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False)), params)
    assert ours == plain and final.stats.rounds > 0


def test_cuda_sampled_output_follows_the_target(tmp_path):
    """Unseeded rejection sampling on the GPU: the first token a round emits is distributed as the target says."""
    V, draws = 8, 800
    target = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=1, vocab=V, logit_scale=8), tmp_path / "t")),
                        CUDA, False)
    draft = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=2, vocab=V, logit_scale=8), tmp_path / "d")),
                       CUDA, False)
    params = SamplingParams(temperature=1.0, max_tokens=3, stop_at_eos=False)
    prompt = [1, 2, 3]
    exact = torch.zeros(V, dtype=torch.float64)
    with torch.no_grad():
        cache = KVCache.for_model(target.model, 16)
        p1 = sampling.process(target.model(torch.tensor([prompt], device="cuda"), cache, last_only=True)[0],
                              params)[0].double().cpu()
        for t1 in range(V):
            cache.rollback(3)
            p2 = sampling.process(target.model(torch.tensor([[t1]], device="cuda"), cache)[0], params)[0]
            exact += p1[t1] * p2.double().cpu()
    engine = Engine(target, 16, DraftModelDrafter(draft, V, 16), SpeculationConfig(draft_max=1, adaptive=False))
    counts = torch.zeros(V, dtype=torch.float64)
    torch.manual_seed(0)
    for _ in range(draws):
        tokens, final = tokens_of(engine, params, prompt)
        counts[tokens[1]] += 1
    assert final.stats.rounds >= 1
    _, dof, p_value = chi_square(counts, exact)
    assert dof >= 3 and p_value > 1e-3, (counts / draws, exact)


def test_cuda_kv_rollback_then_rewrite_equals_straight(models):
    target, _ = models
    m = target.model
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device="cuda")
    with torch.no_grad():
        straight = KVCache.for_model(m, 32)
        m(tokens[:, :5], straight)
        want = m(tokens[:, 5:], straight)
        spec = KVCache.for_model(m, 32)
        m(tokens[:, :5], spec)
        m(torch.tensor([[7, 7, 7]], device="cuda"), spec)
        spec.rollback(5)
        got = m(tokens[:, 5:], spec)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cpu_weight_formats_say_so_on_cuda(tmp_path):
    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path))
    with pytest.raises(QuickdraftError, match="int4 runs on the CPU"):
        load_model(path, EngineConfig(device="cuda", dtype="bfloat16", weights="int4"), progress=False)


def test_cuda_graphs_replay_what_the_eager_passes_compute(models):
    """Loading on CUDA turns graphs on; a prefill, steps and a verification replayed as graphs give the eager
    logits (to bf16 rounding: the graph pads every pass to the same rows), and the check that guards each
    captured graph passed."""
    target, _ = models
    m = target.model
    assert target.graphs is not None
    tokens = torch.tensor([PROMPT], device="cuda")
    runs = []
    with torch.no_grad():
        for graphs in (target.graphs, None):
            saved, target.graphs = target.graphs, graphs
            try:
                cache = KVCache.for_model(m, 128)
                run = target.forward
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
    cpu = load_model(path, EngineConfig(device="cpu", dtype="float32", max_context=256), progress=False)
    gpu = load_model(path, EngineConfig(device="cuda", dtype="bfloat16", max_context=256), progress=False)
    with torch.no_grad():
        want = cpu.model(torch.tensor([TOKENS]), KVCache.for_model(cpu.model))[0]
        got = gpu.model(torch.tensor([TOKENS], device="cuda"), KVCache.for_model(gpu.model))[0].cpu()
    assert float((got - want).abs().max()) <= 5e-2 * float(want.abs().max())
    params = SamplingParams(max_tokens=32, stop_at_eos=False)
    plain, _ = tokens_of(Engine(gpu, 256), params, TOKENS)
    ours, final = tokens_of(Engine(gpu, 256, DraftModelDrafter(gpu, gpu.config.vocab_size, 256),
                                   SpeculationConfig(draft_max=4, adaptive=False)), params, TOKENS)
    assert ours == plain and final.stats.draft_n_accepted == final.stats.draft_n > 0
