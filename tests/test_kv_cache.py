"""Rollback is a pointer move, and rewriting after a rollback equals never having gone further."""

import torch

from quickdraft.config import EngineConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model


def tiny(tmp_path):
    save_hf_dir(tiny_hf_model("qwen2"), tmp_path)
    return load_model(str(tmp_path), EngineConfig(device="cpu", dtype="float32", max_context=64), progress=False)


def test_rollback_then_rewrite_equals_straight_decoding(tmp_path):
    lm = tiny(tmp_path)
    straight = KVCache.for_model(lm.model)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():  # the same chunks with and without the detour, so row counts match
        lm.model(tokens[:, :5], straight)
        want = lm.model(tokens[:, 5:], straight)
        spec = KVCache.for_model(lm.model)
        lm.model(tokens[:, :5], spec)
        lm.model(torch.tensor([[7, 7, 7]]), spec)  # a rejected continuation
        spec.rollback(5)
        assert spec.length == 5
        got = lm.model(tokens[:, 5:], spec)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    n = straight.length
    assert spec.length == n
    for got_layer, want_layer in zip(spec.k + spec.v, straight.k + straight.v):
        torch.testing.assert_close(got_layer[:, :, :n], want_layer[:, :, :n], rtol=0, atol=0)


def test_cache_is_preallocated_and_written_in_place():
    cache = KVCache([(1, 4, 0), (1, 4, 1)], 16)  # two layers of one key/value head of 4
    k_storage = cache.k[0].data_ptr()
    keys, _ = cache.write(0, torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
    assert keys.shape == (1, 1, 3, 4) and cache.k[0].data_ptr() == k_storage
