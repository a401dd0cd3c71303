"""Our transformer's logits equal Hugging Face transformers' on the same tiny random weights."""

import pytest
import torch

from quickdraft.config import EngineConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model, write_gguf_from_hf

pytest.importorskip("transformers")

ARCHS = ["llama", "qwen2", "qwen3"]
FP32 = EngineConfig(device="cpu", dtype="float32", max_context=256)


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def full_forward(lm, tokens):
    cache = KVCache.for_model(lm.model)
    with torch.no_grad():
        return lm.model(torch.tensor([tokens]), cache)[0]


def cached_decode(lm, tokens, prefill=3):
    """Prefill a few tokens, then one token per step through the cache."""
    cache = KVCache.for_model(lm.model)
    with torch.no_grad():
        out = [lm.model(torch.tensor([tokens[:prefill]]), cache)[0]]
        out += [lm.model(torch.tensor([[t]]), cache)[0] for t in tokens[prefill:]]
    return torch.cat(out)


TOKENS = [5, 17, 250, 3, 99, 42, 7, 311, 64, 128, 1, 200, 13, 77]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(HF model, our model loaded from its safetensors dir, our model loaded from a converter-style GGUF)."""
    arch = request.param
    hf = tiny_hf_model(arch)
    d = tmp_path_factory.mktemp(arch)
    save_hf_dir(hf, d / "hf")
    gguf_path = write_gguf_from_hf(hf, d / "model.gguf")
    return hf, load_model(str(d / "hf"), FP32, progress=False), load_model(str(gguf_path), FP32, progress=False)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_full_forward_matches_hf(pair, source):
    hf, from_st, from_gguf = pair
    ours = from_st if source == "safetensors" else from_gguf
    torch.testing.assert_close(full_forward(ours, TOKENS), hf_logits(hf, TOKENS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_cached_decoding_matches_full_forward(pair, source):
    hf, from_st, from_gguf = pair
    ours = from_st if source == "safetensors" else from_gguf
    torch.testing.assert_close(cached_decode(ours, TOKENS), full_forward(ours, TOKENS), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached_decode(ours, TOKENS), hf_logits(hf, TOKENS), rtol=1e-4, atol=1e-4)


def test_config_read_from_both_sources(pair):
    hf, from_st, from_gguf = pair
    a, b = from_st.config, from_gguf.config
    assert a == b.replace(norm_eps=a.norm_eps)  # GGUF stores eps as float32
    assert b.norm_eps == pytest.approx(a.norm_eps)
    expected_head_dim = 32 if hf.config.model_type == "qwen3" else 64 // 4
    assert a.head_dim == expected_head_dim


def test_llama_gguf_without_unpermuting_is_wrong(tmp_path):
    """The rotary permutation matters: reading a llama GGUF as if it were qwen2-style breaks the logits."""
    hf = tiny_hf_model("llama")
    path = write_gguf_from_hf(hf, tmp_path / "m.gguf")
    ours = load_model(str(path), FP32, progress=False)
    reference = hf_logits(hf, TOKENS)
    right_error = (full_forward(ours, TOKENS) - reference).abs().max()
    from quickdraft.weights import gguf as gguf_io

    original = gguf_io.unpermute_rotary
    try:
        gguf_io.unpermute_rotary = lambda w, heads: w
        wrong = load_model(str(path), FP32, progress=False)
    finally:
        gguf_io.unpermute_rotary = original
    wrong_error = (full_forward(wrong, TOKENS) - reference).abs().max()
    assert right_error < 1e-4 and wrong_error > 100 * right_error, (right_error, wrong_error)


def test_tied_embeddings(tmp_path):
    hf = tiny_hf_model("qwen2", tie=True)
    path = write_gguf_from_hf(hf, tmp_path / "m.gguf")
    ours = load_model(str(path), FP32, progress=False)
    assert ours.config.tie_embeddings and ours.model.output is None
    torch.testing.assert_close(full_forward(ours, TOKENS), hf_logits(hf, TOKENS), rtol=1e-4, atol=1e-4)


def test_projections_fuse_as_their_parts_arrive_in_any_order():
    from quickdraft.errors import QuickdraftError
    from quickdraft.weights.names import fused

    q, k, v = torch.ones(4, 2), 2 * torch.ones(2, 2), 3 * torch.ones(2, 2)
    stream = [("layers.0.attention.wv.weight", v), ("norm.weight", torch.ones(2)),
              ("layers.0.attention.wq.weight", q), ("layers.0.attention.wk.weight", k)]
    out = list(fused(stream))
    assert [n for n, _ in out] == ["norm.weight", "layers.0.attention.wqkv.weight"]
    assert torch.equal(out[1][1], torch.cat([q, k, v]))  # q, k, v order whatever the arrival order
    with pytest.raises(QuickdraftError, match="lacks parts"):
        list(fused([("layers.1.feed_forward.w1.weight", q)]))
