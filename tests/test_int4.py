"""The int4 weight-only path against its plain reference."""

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.quant import int4
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


def test_int4_model_close_to_bf16_and_exact_under_speculation(tmp_path):
    path = str(save_hf_dir(tiny_hf_model("qwen2", logit_scale=5), tmp_path))
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
    dense = load_model(path, cfg, progress=False)
    quant = load_model(path, EngineConfig(**{**cfg.__dict__, "weights": "int4"}), progress=False)
    assert isinstance(quant.model.layers[0].attention.wqkv, int4.Int4Linear)
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    prompt = [3, 14, 15, 92, 65]
    dense_tokens = [e.token for e in Engine(dense, 128).generate(prompt, params) if e.token is not None]
    quant_tokens = [e.token for e in Engine(quant, 128).generate(prompt, params) if e.token is not None]
    assert dense_tokens[:4] == quant_tokens[:4]  # 4-bit weights: the same argmax at first


def test_int4_needs_cpu_bf16(tmp_path):
    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path))
    with pytest.raises(QuickdraftError, match="int4 runs on the CPU"):
        load_model(path, EngineConfig(device="cpu", dtype="float32", weights="int4"), progress=False)
