"""The CUDA weight formats, on the CPU: GGUF 4-bit blocks converted to tinygemm's codes, scales and zeros (through
its CPU twin, `_weight_int4pack_mm_for_cpu`, which takes the same layout), the Triton int8 kernel under Triton's
interpreter, and the memory plan against stated device sizes. tests/test_cuda.py runs the kernels on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from quickdraft.quant import gpu, int4
from quickdraft.quant.blocks import four_bit_grid
from quickdraft.weights.gguf import FileRows, StackedRows
from tests.test_gguf_types import random_blocks

ROOT = Path(__file__).resolve().parents[1]


def file_rows(qtype, rows, cols, seed=0):
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return FileRows(raw, qtype, (rows, cols), torch.float32), quants.dequantize(raw, qtype)


def bound(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The stated bound of a converted weight against the file's value, per group: the bf16 rounding of the scale
    (times the code's distance from 8, at most 8) and of the zero, each at most half a unit in the last place
    (2^-8 of the value: bf16 keeps 8 significant bits), and float32 rounding."""
    return 2.0 ** -8 * (8 * scale.abs() + zero.abs()) * (1 + 2 ** -7) + 1e-6 * scale.abs()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_four_bit_blocks_are_their_own_codes_and_grids(qtype):
    rows, want = file_rows(qtype, 16, 512)
    q, scale, lo = four_bit_grid(torch.from_numpy(rows.raw), qtype)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and q.shape == (16, 512) and scale.shape == (16, 16)
    got = int4.dequantize(q, scale, lo)
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype, n, k", [(T.Q4_0, 64, 512), (T.Q4_1, 64, 512), (T.Q4_K, 64, 512),
                                         (T.Q4_0, 32, 64), (T.Q4_1, 80, 64)])  # and a head's: K under one tile
def test_blocks_through_tinygemm_layout_reproduce_the_dequantized_weights(qtype, n, k):
    """The layer built from the blocks (codes kept, bf16 scale and zero) multiplies by the file's weights within
    the stated bound: identity activations read the weight back through PyTorch's kernel (its CPU twin)."""
    rows, want = file_rows(qtype, n, k, seed=1)
    layer = int4.Int4Linear(rows.grid(), None)
    assert not layer.vnni and layer.scales_and_zeros.dtype == torch.bfloat16
    sz = layer.scales_and_zeros.float()  # (K / 32, N, 2)
    scale, zero = sz[..., 0].t(), sz[..., 1].t()
    q, _, _ = four_bit_grid(torch.from_numpy(rows.raw), qtype)
    got = layer.dequantized(q)
    err = (got - torch.from_numpy(want)).abs().reshape(n, -1, 32).amax(-1)
    assert bool((err <= bound(scale, zero)).all()), float((err / bound(scale, zero)).max())
    if qtype == T.Q4_0:  # zero = lo + 8 d = 0 exactly: only the scale rounds
        assert float(zero.abs().max()) == 0
    x = torch.eye(k, dtype=torch.bfloat16)
    through_kernel = layer(x).float().t()  # the kernel's weights, rounded to bf16 on the way out
    torch.testing.assert_close(through_kernel, got, rtol=2 ** -8, atol=1e-6)


def test_fused_parts_convert_as_one_matrix():
    """q, k and v in 4-bit blocks concatenate row-wise as their blocks (StackedRows): the same codes as the parts'."""
    a, wa = file_rows(T.Q4_K, 32, 256, seed=2)
    b, wb = file_rows(T.Q4_0, 16, 256, seed=3)
    stacked = StackedRows([a, b])
    assert stacked.four_bit and stacked.shape == (48, 256)
    q, scale, lo = stacked.grid().rows(20, 40, "cpu")
    want = np.concatenate([wa, wb])[20:40]
    torch.testing.assert_close(int4.dequantize(q, scale, lo), torch.from_numpy(want), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stacked[20:40], torch.from_numpy(want))


def test_fitted_rows_on_tinygemm_layout_round_against_the_stored_grid():
    """Float rows (a Q6_K or bf16 source asked for int4) fit their grids, and each code is the nearest on the
    grid as stored (bf16 scale and zero), not as fitted."""
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    q, sz = int4._tinygemm_grid(w, 0, 32, torch.device("cpu"))
    s, z = sz[..., 0].t().float(), sz[..., 1].t().float()
    groups = w.reshape(32, -1, 32)
    back = (q.reshape(32, -1, 32).float() - 8) * s[..., None] + z[..., None]
    for delta in (-1, 1):  # no neighbouring code is closer
        other = ((q.reshape(32, -1, 32).float() + delta).clamp(0, 15) - 8) * s[..., None] + z[..., None]
        assert bool(((back - groups).abs() <= (other - groups).abs() + 1e-6).all())


def test_int4_shape_rules_on_cuda():
    assert gpu.int4_supported(896, 4864) and gpu.inner_k_tiles(896) == 8
    assert gpu.int4_supported(32, 64) and gpu.inner_k_tiles(64) == 4  # a head's k_proj: K under one 128-wide tile
    assert not gpu.int4_supported(80, 80)  # a head's down projection (K = 80): stays bf16, never a wrong pack
    assert gpu.int4_supported(8, 96) and gpu.inner_k_tiles(96) == 2
    assert not gpu.int4_supported(12, 128)  # whole tiles of 8 outputs
    assert not gpu.int4_supported(16, 80)  # whole groups of 32 inputs


INTERPRETED = r"""
import torch
from quickdraft.quant import gpu, int8
torch.manual_seed(0)
cases = [(1, 64, 256, 1), (17, 96, 384, 3), (5, 64, 200, 2), (40, 128, 256, 2), (70, 80, 128, 1),
         # the EAGLE-3 and DSpark heads' shapes: K (64, 80) under one block, N (32, 80) under or across one tile
         (1, 32, 64, 1), (16, 80, 64, 1), (5, 32, 80, 1), (16, 80, 80, 1), (40, 32, 64, 1)]
for m, n, k, splits in cases:
    x = torch.randn(m, k).bfloat16()
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, bias = torch.rand(n) * 0.01, torch.randn(n).bfloat16()
    got = gpu.int8_mm(x, q, scale, bias, splits)
    want = gpu.int8_reference(x, q, scale, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    err = float((got.float() - want.float()).abs().max())
    assert err <= 2 ** -7 * float(want.float().abs().max()), (m, n, k, err)
    for i in (0, m - 1):  # in a decode-sized pass a row alone gives bit for bit what it gives among the others
        if m <= gpu.DECODE_ROWS:
            assert torch.equal(gpu.int8_mm(x[i:i + 1].contiguous(), q, scale, bias, splits)[0], got[i]), (m, i)
    if m > 1:
        assert torch.equal(gpu.int8_mm(x, q, scale, None, splits), gpu.int8_mm(x, q, scale, None, splits))
print("ok")
"""


def test_triton_int8_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# --- the memory plan -------------------------------------------------------------------------------------------

def case_27b(fmt="mixed"):
    """The 27B class: a 27B-class target from a Q4_K_M file (llama.cpp's recipe) with the 0.5B-class draft in
    int4 (its file in Q8_0, as the default draft's), 8k positions."""
    from gguf import GGMLQuantizationType as T

    from quickdraft.tools import roofline
    from quickdraft.weights import memory

    target, draft = roofline.STAND_INS["dense-27b-class"], roofline.STAND_INS["qwen2.5-coder-0.5b"]
    t_types = roofline.q4_k_m_types(target)
    d_types = {name: T.Q8_0 for name in roofline.q4_k_m_types(draft)}
    t_bytes = {"tok_embeddings.weight": target.vocab_size * target.dim * 144 // 256}  # Q4_K: 144 bytes / 256
    d_bytes = {"tok_embeddings.weight": draft.vocab_size * draft.dim * 34 // 32}  # Q8_0: 34 bytes / 32
    return [memory.ModelSpec("target", "dense-27b-class Q4_K_M", target, fmt, t_types, t_bytes),
            memory.ModelSpec("draft", "0.5b-class Q8_0", draft, "int4", d_types, d_bytes)]


def test_the_27b_class_fits_a_24_gb_card_with_its_figures():
    from quickdraft.weights import memory

    plan = memory.plan(case_27b(), 8192, torch.device("cuda"), capacity=24 * 2**30)
    figures = {i.what: i.nbytes / 2**30 for i in plan.items}
    print("\n".join(plan.lines()))
    assert plan.fits and plan.warning() is None and 0.75 < plan.share < 0.9
    assert 15 < figures["target weights"] < 17  # ~24B weights: 0.625 bytes each in int4, 1 in int8 (the Q6_K parts)
    assert 1.9 < figures["target KV cache"] < 2.1  # 64 layers x 4 heads x 256 x 2 x 2 bytes x 8192
    assert 0.3 < figures["draft weights"] < 0.5 and figures["CUDA context"] > 0.5
    assert "76% int4, 24% int8" in plan.items[0].detail


def test_the_27b_class_is_refused_on_a_16_gb_card_with_the_numbers():
    from quickdraft.errors import QuickdraftError
    from quickdraft.tools.flags import say
    from quickdraft.weights import memory

    plan = memory.plan(case_27b(), 8192, torch.device("cuda"), capacity=16 * 2**30)
    assert not plan.fits
    with pytest.raises(QuickdraftError) as e:
        memory.check(plan)
    text = say(e.value)  # as the command line writes it: its flags
    assert "do not fit on cuda" in text and "need 19.2 GiB" in text and "16.0 GiB of 16.0 GiB is free" in text
    assert "target weights 16.0" in text and "--ctx" in text and "--weights int4, from mixed" in text
    assert "--draft-weights" not in text  # the draft is in int4 already


def test_above_90_percent_a_warning_names_what_to_lower():
    from quickdraft.tools.flags import say
    from quickdraft.weights import memory

    plan = memory.plan(case_27b("int4"), 28672, torch.device("cuda"), capacity=24 * 2**30)
    warned = []
    memory.check(plan, warn=warned.append)
    assert plan.fits and len(warned) == 1
    warned = [say(w) for w in warned]
    assert "above 90%" in warned[0] and "--ctx" in warned[0] and "KV caches take 7.3 GiB" in warned[0]


def test_doctor_reports_the_plan():
    from quickdraft.tools import doctor
    from quickdraft.weights import memory

    ok = doctor.memory_plan(memory.plan(case_27b(), 8192, torch.device("cuda"), capacity=24 * 2**30))
    assert ok.level == "ok" and "no layer is offloaded" in ok.message and "of 24.0 GiB" in ok.message
    assert ok.figures["items"][0]["what"] == "target weights"
    tight = doctor.memory_plan(memory.plan(case_27b("int4"), 28672, torch.device("cuda"), capacity=24 * 2**30))
    assert tight.level == "warn" and "above 90%" in tight.message
    refused = doctor.memory_plan(memory.plan(case_27b(), 8192, torch.device("cuda"), capacity=16 * 2**30))
    assert refused.level == "error" and "do not fit" in refused.message


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny qwen2 file: 4-bit layers (Q4_0 and Q4_1), a Q8_0 table."""
    from tests.helpers import tiny_hf_model, write_gguf_from_hf

    model = tiny_hf_model("qwen2", vocab=512)
    layer_types = {"attn_q.weight": T.Q4_0, "attn_k.weight": T.Q4_0, "attn_v.weight": T.Q4_1,
                   "attn_output.weight": T.Q4_1, "ffn_gate.weight": T.Q4_0, "ffn_up.weight": T.Q4_0,
                   "ffn_down.weight": T.Q8_0}
    return write_gguf_from_hf(model, tmp_path_factory.mktemp("plan") / "tiny.gguf", table_type=T.Q8_0,
                              layer_types=layer_types)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mixed"])
def test_the_plan_counts_what_the_load_allocates(tiny_gguf, fmt):
    """Planned weight bytes equal the loaded model's parameters and buffers (rotary tables aside), per format."""
    from quickdraft.config import EngineConfig
    from quickdraft.weights import memory
    from quickdraft.weights.loader import load_model

    spec = memory.spec_from_source("target", str(tiny_gguf), fmt)
    planned, _ = memory.weight_bytes(spec.cfg, fmt, torch.device("cpu"), spec.types, spec.file_bytes)
    lm = load_model(str(tiny_gguf), EngineConfig(device="cpu", dtype="bfloat16", weights=fmt, max_context=64,
                                                 weight_cache=False), progress=False)
    loaded = sum(t.numel() * t.element_size() for n, t in [*lm.model.named_parameters(), *lm.model.named_buffers()]
                 if not n.startswith("rope_"))
    assert planned == loaded, (planned, loaded)
    kv = memory.kv_bytes(spec.cfg, 64)
    from quickdraft.runtime.kv_cache import KVCache

    assert kv == KVCache.for_model(lm.model, 64).nbytes()


GRID_LOAD = r"""
import sys, torch
from gguf import GGMLQuantizationType as T
from quickdraft.config import EngineConfig
from quickdraft.quant import int4, vnni
from quickdraft.weights import gguf as gguf_io
from quickdraft.quant.blocks import dequantize, four_bit_grid
from quickdraft.weights.loader import load_model
assert not vnni.available()
path = sys.argv[1]
lm = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights="int4", max_context=64, weight_cache=False),
                progress=False)
reader = gguf_io.open_gguf(path)
raw = {t.name: t for t in reader.tensors}
layer = lm.model.layers[0].attention.wqkv
assert isinstance(layer, int4.Int4Linear) and not layer.vnni
parts = [raw[f"blk.0.attn_{p}.weight"] for p in "qkv"]
want = torch.cat([dequantize(t.data, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), torch.float32)
                  for t in parts])
codes = torch.cat([four_bit_grid(torch.from_numpy(t.data.copy()), t.tensor_type)[0] for t in parts])
got = layer.dequantized(codes)
step = (want.reshape(want.shape[0], -1, 32).amax(-1) - want.reshape(want.shape[0], -1, 32).amin(-1)) / 15
err = (got - want).abs().reshape(want.shape[0], -1, 32).amax(-1)
assert float((err / step.clamp_min(1e-12)).max()) < 1 / 16, float((err / step).max())
down = lm.model.layers[0].feed_forward.w2  # a Q8_0 part in int4: fitted, not exact
assert isinstance(down, int4.Int4Linear)
print("ok")
"""


def test_a_cpu_without_quickdraft_kernels_loads_4_bit_blocks_as_they_are(tiny_gguf):
    """Where int4 takes tinygemm's layout (CUDA, or PyTorch's CPU twin without VNNI), the loader gives the layer the
    file's own codes: a fused q/k/v of Q4_0 and Q4_1 parts is the file's weights to within 1/16 of a step."""
    env = {**os.environ, "QUICKDRAFT_NO_VNNI": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", GRID_LOAD, str(tiny_gguf)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
