"""Graphed passes (runtime/graphs.py) on the CPU: the position-independent pass they capture
(Transformer.forward_at) against forward, and their bookkeeping (padding, spans, the check that turns them off)
with a stand-in capture that reruns the pass. tests/test_cuda.py runs the same paths as real CUDA graphs."""

import gc

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime import graphs
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.draft_model import DraftModelDrafter
from tests.helpers import target_and_noisy_draft, tokens_of

CPU = EngineConfig(device="cpu", dtype="float32", max_context=256)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_noisy_draft(tmp_path_factory.mktemp("graphs"), CPU)


def test_forward_at_equals_forward(models):
    m = models[0].model
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    with torch.no_grad():
        plain, at = KVCache.for_model(m, 64), KVCache.for_model(m, 64)
        for lo, hi in ((0, 6), (6, 7), (7, 10), (10, 12)):  # a prefill, a step, a verification, then two more
            want = m(tokens[:, lo:hi], plain)
            got = m.forward_at(tokens[:, lo:hi], torch.arange(lo, hi), at, span=32)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(at.k + at.v, plain.k + plain.v):
            torch.testing.assert_close(a[:, :, :12], b[:, :, :12], rtol=1e-5, atol=1e-5)
    assert at.length == 0  # forward_at leaves the length to its caller


def with_graphs(lm, **kw):
    lm.graphs = graphs.StepGraphs(lm.model, **kw)
    return lm.graphs


@pytest.mark.parametrize("spec", [SpeculationConfig(draft_max=3, adaptive=False), SpeculationConfig(draft_max=16)])
def test_graphed_speculative_output_equals_graphed_plain_and_eager(models, spec):
    target, draft = models
    params = SamplingParams(max_tokens=60, stop_at_eos=False)
    eager, _ = tokens_of(Engine(target, 256), params)
    try:
        g = with_graphs(target)
        with_graphs(draft)
        engines = [Engine(target, 256)]
        plain, _ = tokens_of(engines[0], params)
        drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
        engines.append(Engine(target, 256, drafter, spec))
        ours, final = tokens_of(engines[1], params)
        caches = len(g.graphs)
        del engines
        gc.collect()
        left = len(g.graphs)
    finally:
        target.graphs = draft.graphs = None
    assert ours == plain == eager
    assert final.stats.rounds > 0 and g.disabled is None
    assert caches == 2  # one graph for each engine's cache
    assert left == 0  # gone with the caches: a graph never keeps a cache alive beyond its owner


def test_passes_too_wide_or_too_near_the_end_run_eagerly(models):
    m = models[0].model
    g = graphs.StepGraphs(m, width=4)
    cache = KVCache.for_model(m, 12)
    assert not g.applies(torch.zeros(1, 5, dtype=torch.long), cache)  # wider than the graph
    assert g.applies(torch.zeros(1, 4, dtype=torch.long), cache)
    cache.length = 9
    assert not g.applies(torch.zeros(1, 1, dtype=torch.long), cache)  # the padding would pass the capacity
    assert not g.applies(torch.zeros(2, 1, dtype=torch.long), KVCache.for_model(m, 12, batch=2))


def test_a_graph_that_disagrees_with_the_eager_pass_is_never_used(models):
    target, _ = models

    def wrong(fn):
        replay, output = graphs.eager_capture(fn)
        return (lambda: (replay(), output.mul_(1.5))), output

    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    want, _ = tokens_of(Engine(target, 256), params)
    try:
        g = with_graphs(target, capture=wrong)
        with pytest.warns(RuntimeWarning, match="CUDA graphs are off for this model"):
            got, _ = tokens_of(Engine(target, 256), params)
    finally:
        target.graphs = None
    assert got == want and "differ from the eager pass" in g.disabled and not g.graphs
