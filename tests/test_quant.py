"""The int8 and int4 weight-only paths against their plain references."""

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.quant import int4, int8
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model


def test_kernel_matches_dequantized_reference():
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    layer = int4.Int4Linear(w, torch.randn(96))
    q, _ = int4.quantize(w)
    reference_w = layer.dequantized(q)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    want = x.float() @ reference_w.t() + layer.bias.float()
    got = layer(x).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.15)
    # the reference itself is a faithful 4-bit approximation of the original weights
    step = (w.reshape(96, -1, int4.GROUP).amax(-1) - w.reshape(96, -1, int4.GROUP).amin(-1)) / 15
    err = (reference_w - w).abs().reshape(96, -1, int4.GROUP).amax(-1)
    assert (err <= 0.5 * step + 0.02 * step.abs().max()).all()


def test_rows_are_independent_of_batch_size():
    torch.manual_seed(1)
    layer = int4.Int4Linear(torch.randn(64, 128), None)
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    full = layer(x)
    assert all(torch.equal(layer(x[i:i + 1])[0], full[i]) for i in range(9))


def test_int8_kernel_matches_dequantized_reference():
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    layer = int8.Int8Linear(w, torch.randn(96))
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    want = x.float() @ layer.dequantized().t() + layer.bias.float()
    torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=0.15)
    # half a step of rounding at most: the step is a row's largest |w| / 127
    step = w.abs().amax(-1, keepdim=True) / 127
    assert ((layer.dequantized() - w).abs() <= 0.51 * step).all()


@pytest.mark.parametrize("kind", [int4.Int4Linear, int8.Int8Linear])
def test_rows_are_independent_of_batch_size(kind):
    torch.manual_seed(1)
    layer = kind(torch.randn(64, 128), None)
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    full = layer(x)
    assert all(torch.equal(layer(x[i:i + 1])[0], full[i]) for i in range(9))


@pytest.mark.parametrize("fmt,kind,same", [("int4", int4.Int4Linear, 4), ("int8", int8.Int8Linear, 12)])
def test_quantized_model_close_to_bf16(tmp_path, fmt, kind, same):
    path = str(save_hf_dir(tiny_hf_model("qwen2", logit_scale=5), tmp_path))
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
    dense = load_model(path, cfg, progress=False)
    quant = load_model(path, EngineConfig(**{**cfg.__dict__, "weights": fmt}), progress=False)
    assert isinstance(quant.model.layers[0].attention.wqkv, kind) and isinstance(quant.model.output, kind)
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    prompt = [3, 14, 15, 92, 65]
    dense_tokens = [e.token for e in Engine(dense, 128).generate(prompt, params) if e.token is not None]
    quant_tokens = [e.token for e in Engine(quant, 128).generate(prompt, params) if e.token is not None]
    assert dense_tokens[:same] == quant_tokens[:same]  # the same argmax at first (longer for 8 bits)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_formats_need_cpu_bf16(tmp_path, fmt):
    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path))
    with pytest.raises(QuickdraftError, match=f"{fmt} runs on the CPU"):
        load_model(path, EngineConfig(device="cpu", dtype="float32", weights=fmt), progress=False)
    with pytest.raises(QuickdraftError, match="choose auto, bf16, int8, int4"):
        load_model(path, EngineConfig(device="cpu", weights="int3"), progress=False)


def test_pass_bytes_count_the_runtime_format(tmp_path):
    from quickdraft.roofline import pass_bytes

    path = str(save_hf_dir(tiny_hf_model("qwen2", vocab=512, layers=2), tmp_path))
    sizes = {}
    for fmt in ("bf16", "int8", "int4"):
        lm = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights=fmt), progress=False)
        sizes[fmt] = pass_bytes(lm.model, context=0)
        if fmt == "bf16":  # every weight at 2 bytes but the embedding table, of which one row is read
            m = lm.model
            weights = sum(p.numel() for n, p in m.named_parameters() if n != "tok_embeddings.weight")
            rotary = 2 * 4 * m.cfg.head_dim  # one row of the float32 cos and sin tables
            assert sizes[fmt] == 2 * (weights + m.cfg.dim) + rotary
    assert sizes["int4"] < 0.7 * sizes["int8"] < 0.6 * sizes["bf16"]  # scales and norms weigh on tiny layers


@pytest.mark.parametrize("module", [int4, int8])
def test_quantizing_in_row_chunks_changes_nothing(monkeypatch, module):
    torch.manual_seed(2)
    w = torch.randn(208, 64)  # 3 whole blocks of 64 rows and a tail of 16
    kind = module.Int4Linear if module is int4 else module.Int8Linear
    whole = kind(w, None)
    monkeypatch.setattr(module, "ROWS", 64)  # four chunks (the int4 packing works in blocks of 64 rows)
    chunked = kind(w, None)
    assert all(torch.equal(a, b) for a, b in zip(whole.buffers(), chunked.buffers()))
