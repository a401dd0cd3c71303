"""What a GPU would feel, caught on the CPU: no pass copies from the host or waits for it (a CUDA graph capture would
fail, a sync per token would serialise Python with the device), drafts stay on the device until a round's end, the
kernels' row tile bounds the passes and the drafts, every short pass is computed as one shape, graphs hold their
caches weakly, and the Triton kernel's K slices are never empty. tests/test_cuda.py runs the GPU itself."""

import gc
import weakref

import pytest
import torch

from quickdraft import sampling
from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.quant import gpu
from quickdraft.runtime import graphs
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.accept import accept_greedy, accept_sampled
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.weights.loader import load_model
from tests.guards import HostTraffic
from tests.helpers import PROMPT, save_hf_dir, target_and_noisy_draft, tiny_hf_model, tokens_of, write_gguf_from_hf

BF16 = EngineConfig(device="cpu", dtype="bfloat16", max_context=256)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return target_and_noisy_draft(tmp_path_factory.mktemp("pair"), BF16)


# --- passes: nothing copied in, nothing read back --------------------------------------------------------------

@pytest.fixture(scope="module")
def q4_k_m_like(tmp_path_factory):
    """A tiny qwen2 GGUF whose token table is in Q6_K, as the default target's (a Q4_K_M file) is."""
    from gguf import GGMLQuantizationType as T

    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    model = tiny_hf_model("qwen2", vocab=512, hidden_size=256, intermediate_size=256)  # K-quant rows: 256 wide
    return write_gguf_from_hf(model, path, table_type=T.Q6_K,
                              layer_types={"attn_q.weight": T.Q4_K, "ffn_down.weight": T.Q6_K})


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mixed"])
def test_a_pass_neither_copies_from_the_host_nor_reads_back(q4_k_m_like, fmt):
    """The passes a CUDA graph captures (forward_at) and the eager steps and verifications, over a table in the
    file's Q6_K blocks: a list turned into a device tensor inside a pass is a host-to-device copy, which a capture
    refuses (the whole model then ran eagerly); a value read back is a sync."""
    lm = load_model(str(q4_k_m_like), EngineConfig(device="cpu", dtype="bfloat16", weights=fmt, max_context=64),
                    False)
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        cache = KVCache.for_model(lm.model, 64)
        lm.forward(tokens[:, :8], cache)
        with HostTraffic() as traffic:
            lm.forward(tokens[:, 8:9], cache)  # a step
            lm.forward(tokens[:, 9:14], cache)  # a verification
            lm.model.forward_at(tokens[:, :graphs.WIDTH], torch.arange(14, 14 + graphs.WIDTH), cache, 64)
    assert not traffic.copies and not traffic.reads, (traffic.copies, traffic.reads)


@pytest.mark.parametrize("name, kept", [("gemma2", "features"), ("gemma4", "hidden"), ("mistral-window", "features"),
                                        ("phi3", None)])
def test_every_familys_graphed_pass_neither_copies_from_the_host_nor_reads_back(tmp_path, name, kept):
    """The pass a CUDA graph captures (forward_at), per family: gemma2's soft caps, gemma4's per-layer inputs and
    shared caches, sliding windows, phi3's partial rotary; with the cache keeping the layer features an EAGLE-3,
    DSpark or DFlash drafter reads, or the hidden states MTP reads. Any copy from the host or read-back there would
    make a real capture fail, and the family run eagerly."""
    from tests.families import TOKENS, save, tiny_model

    lm = load_model(str(save(tiny_model(name), tmp_path)), EngineConfig(device="cpu", dtype="bfloat16",
                                                                        max_context=64), False)
    with torch.inference_mode():
        cache = KVCache.for_model(lm.model, 64)
        if kept == "features":
            cache.keep_features([0, lm.config.n_layers - 1], lm.config.dim)
        elif kept == "hidden":
            cache.keep_hidden(lm.config.dim)
        lm.forward(torch.tensor([TOKENS[:8]]), cache)
        with HostTraffic() as traffic:
            lm.model.forward_at(torch.tensor([TOKENS[:graphs.WIDTH]]), torch.arange(8, 8 + graphs.WIDTH), cache, 64)
    assert not traffic.copies and not traffic.reads, (traffic.copies, traffic.reads)


def test_accepting_a_round_reads_back_once():
    torch.manual_seed(0)
    k, V = 5, 11
    p = torch.softmax(torch.randn(k + 1, V), -1)
    q = torch.softmax(torch.randn(k, V), -1)
    drafts = torch.multinomial(q, 1).squeeze(-1)
    for accept in (lambda: accept_greedy(p.argmax(-1), drafts), lambda: accept_sampled(p, q, drafts, None)):
        with HostTraffic() as traffic:
            tokens, n = accept()
        assert len(traffic.reads) == 1 and len(tokens) == n + 1, traffic.reads


# --- drafts stay on the device ------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, stop_at_eos=False),
                                    SamplingParams(temperature=0.9, seed=5, max_tokens=40, stop_at_eos=False)],
                         ids=["greedy", "seeded"])
def test_drafts_read_back_once_a_round_where_they_stay_on_the_device(pair, monkeypatch, params):
    """On a GPU a draft model's round keeps its drafts on the device and reads them back once, after the last
    (p_min's early stop applied to what was read): here the CPU is made to take that path. Its output equals plain
    decoding, and each round's drafting read back exactly once."""
    target, draft = pair
    plain, _ = tokens_of(Engine(target, 256), params)
    monkeypatch.setattr(DraftModelDrafter, "_resident", lambda self, constraint, params: constraint is None)
    monkeypatch.setattr(DraftModelDrafter, "batchable", False)  # as on a GPU: each round proposes whole
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256, p_min=0.5)
    reads = []
    propose = drafter.propose

    def counted(*args, **kwargs):
        with HostTraffic() as traffic:
            proposal = propose(*args, **kwargs)
        if proposal.tokens:
            reads.append(len(traffic.reads))
        return proposal

    drafter.propose = counted
    ours, final = tokens_of(Engine(target, 256, drafter, SpeculationConfig(draft_max=6, adaptive=False)), params)
    assert ours == plain
    assert final.stats.rounds > 0 and set(reads) == {1}, reads
    assert drafter.tokens == drafter.tokens[:drafter.cache.length] and len(drafter.tokens) == drafter.cache.length


def test_each_device_draws_with_its_own_generator():
    """A draft on another device than the target's draws with a generator of its own device (torch.multinomial
    refuses any other): one per device, made once per generation."""
    generators = sampling.Generators(None)
    assert generators.on("cpu") is generators.on(torch.device("cpu"))
    assert generators.on("cpu").device == torch.device("cpu")
    if torch.cuda.is_available():
        assert generators.on("cuda").device.type == "cuda" and generators.on("cuda") is generators.on("cuda:0")


# --- short passes: one shape, bounded by the kernels' tile -----------------------------------------------------

def test_the_graphs_and_the_drafts_fit_the_kernels_row_tile(pair):
    """tinygemm computes rows in tiles of 16: a graphed pass of 17 rows read every int4 weight twice. The graphs are
    one tile wide, and on CUDA (rows set) a round drafts at most what fits in it."""
    target, draft = pair
    assert graphs.WIDTH == gpu.ROW_TILE == 16
    try:
        target.rows = graphs.WIDTH
        engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256))
        assert engine.max_draft == graphs.WIDTH - 1
    finally:
        target.rows = None
    assert Engine(target, 256).max_draft is None  # the CPU's passes are not padded: no bound of that kind


def build_family(name, tmp_path):
    from tests.families import save, tiny_model
    from tests.test_hybrid import tiny_qwen35
    from tests.test_moe import tiny_moe

    if name == "qwen3_5":
        return save_hf_dir(tiny_qwen35(logit_scale=20), tmp_path)
    if name == "qwen3_5_moe":
        return save_hf_dir(tiny_moe(name, logit_scale=20), tmp_path)
    return save(tiny_model(name), tmp_path)


@pytest.mark.parametrize("name", ["llama3", "gemma3", "qwen3_5", "qwen3_5_moe"])
def test_padded_passes_give_the_real_rows_what_unpadded_passes_give(tmp_path, name):
    """Where no graph runs on CUDA (a hybrid, a mixture of experts) every short pass is padded to the row tile, as a
    graphed pass is (LoadedModel.forward): the real rows' logits and the cache after it (keys and values at the real
    positions, a recurrent state at the last real one) are bit for bit those of the unpadded pass, here on the CPU in bf16,
    whose kernels are row-invariant; and greedy speculation over padded passes equals plain decoding over them."""
    path = str(build_family(name, tmp_path / name))
    lm = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=128), False)
    tokens = torch.tensor([PROMPT])
    runs = []
    with torch.inference_mode():
        for rows in (None, gpu.ROW_TILE):
            lm.rows = rows
            cache = KVCache.for_model(lm.model, 128)
            logits = [lm.forward(tokens[:, :6], cache), lm.forward(tokens[:, 6:7], cache, last_only=True),
                      lm.forward(tokens[:, 7:12], cache)]
            runs.append((logits, cache))
    (want, plain), (got, padded) = runs
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert padded.length == plain.length == 12
    for a, b in zip(padded.tensors(), plain.tensors()):
        assert torch.equal(a[:, :, :12], b[:, :, :12])
    for a, b in zip(padded.recurrent, plain.recurrent):
        assert torch.equal(a.ssm, b.ssm) and torch.equal(a.conv, b.conv)
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    plain_tokens, _ = tokens_of(Engine(lm, 128), params)
    drafter = DraftModelDrafter(lm, lm.config.vocab_size, 128)
    ours, final = tokens_of(Engine(lm, 128, drafter, SpeculationConfig(draft_max=4, adaptive=False)), params)
    assert ours == plain_tokens and final.stats.rounds > 0


# --- graphs live as long as their caches -------------------------------------------------------------------------

def test_a_graph_does_not_keep_its_cache_alive(pair):
    """A graph writes into its cache's tensors: it is dropped with the cache, so the caches that live are the ones
    their owners (an engine, a drafter, a benchmark) hold, which is what the memory plan counts."""
    target, _ = pair
    g = graphs.StepGraphs(target.model)
    cache = KVCache.for_model(target.model, 64)
    with torch.inference_mode():
        g.run(torch.tensor([PROMPT[:3]]), cache, last_only=True)
    assert len(g.graphs) == 1
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None and not g.graphs


# --- the Triton int8 kernel -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, k", [(896, 4864), (4864, 896), (1536, 8960), (8960, 1536), (151936, 1536),
                                  (5120, 17408), (384, 896), (64, 128)])
def test_the_int8_kernel_splits_k_into_slices_none_of_them_empty(n, k):
    """A slice's size is rounded up to whole blocks: the count must be taken again after that, else the last
    programs multiply nothing (896 x 4864 asked for 16 slices of 384 inputs: 13 cover K)."""
    splits = gpu.int8_splits(n, k)
    count, per_split = gpu.int8_slices(k, splits)
    assert count == splits and (splits - 1) * per_split < k <= splits * per_split and per_split % gpu.BLOCK_K == 0
