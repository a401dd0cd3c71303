"""quickdraft's own CPU kernels (csrc/vnni.cpp: AVX-512 VNNI), built on first use, and their plain references.

PyTorch's weight-only CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) multiply in floating
point, converting every weight for every row of activations: they stay well below the memory bandwidth for one
row, and their cost grows about linearly with the rows. These kernels quantize the activations (int8, one scale
per row) and multiply bytes by `vpdpbusd`, 64 products per instruction, so one row runs near memory speed and
verifying k+1 rows reads the weights once (docs/performance.md, "quickdraft's CPU kernels", has the figures).
The extension also holds the attention of decode and verification passes (`decode_attention`: each row
alone, batch invariant, in one call instead of one SDPA call per row) and the int4 grid fit (`int4_fit`).

The extension is built on first use (quant/extension.py); where the CPU lacks VNNI or the build fails,
`unavailable_reason()` says why and the layers use PyTorch's ops instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quickdraft.quant import extension
from quickdraft.quant.extension import Extension

SOURCE = Path(__file__).parent / "csrc" / "vnni.cpp"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma", "-ffp-contract=off",
         "-fopenmp"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")

KERNELS = Extension("quickdraft_vnni", SOURCE, FLAGS, CPU_FLAGS, "QUICKDRAFT_NO_VNNI")
cpu_flags = extension.cpu_flags


def extension_name() -> str:
    return KERNELS.name()


def build_lock_path() -> Path | None:
    return KERNELS.lock_path()


def _build_lock():
    return KERNELS.lock()


def available() -> bool:
    return KERNELS.reason() is None


def unavailable_reason() -> str | None:
    return KERNELS.reason()


OUTLIER_RATIO = 100.0  # as kOutlierRatio in csrc/vnni.cpp


def _quantize(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = xf.abs().amax(-1) / 127
    q = torch.round(xf / torch.where(d == 0, 1.0, d)[:, None]).clamp(-127, 127)
    return q, d


def quantize_activations(x: torch.Tensor, group: int):
    """The kernels' activation quantization, in plain PyTorch: each row of x (M, K) as int8 codes (round to
    nearest even of x / d, d = max |x| / 127), plus, for a row of massive activations (max |x| above
    OUTLIER_RATIO times its mean |x|), a second level: the remainder x - d q quantized the same way.
    Returns the levels' codes (L, K) int8, scales d (L,), codes' sums per group (L, K / group) and the row
    each level belongs to (L,)."""
    xf = x.float()
    q, d = _quantize(xf)
    outlier = xf.abs().amax(-1) > OUTLIER_RATIO * xf.abs().mean(-1)
    rows = torch.arange(x.shape[0])
    if outlier.any():
        q2, d2 = _quantize((xf - d[:, None] * q)[outlier])
        q, d, rows = torch.cat([q, q2]), torch.cat([d, d2]), torch.cat([rows, rows[outlier]])
    return q.to(torch.int8), d, q.reshape(q.shape[0], -1, group).sum(-1).to(torch.int32), rows


def _combine(x, q, d, rows, w, bias) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[0]).index_add_(0, rows, (q.float() @ w.t()) * d[:, None])
    return (out + bias.float() if bias is not None else out).to(torch.bfloat16)


def int8_reference(x, u, scales, bias) -> torch.Tensor:
    """What `int8_linear` computes, in float: u (N, K) uint8 holds q + 128."""
    q, d, _, rows = quantize_activations(x, x.shape[-1])
    return _combine(x, q, d, rows, (u.to(torch.int32) - 128).float() * scales[:, None], bias)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K / 2) uint8: in each chunk of 128 (4 groups of 32), byte 16g + i holds
    elements 32g + i (low nibble) and 32g + 16 + i (high nibble): a byte's two codes share a group."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 128, 4, 2, 16)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    p = packed.reshape(n, half // 64, 4, 16)
    return torch.stack([p & 15, p >> 4], dim=3).reshape(n, half * 2)


def int4_reference(x, packed, scales, lows, bias) -> torch.Tensor:
    """What `int4_linear` computes, in float: w = code * scale + low per group of 32."""
    q, d, _, rows = quantize_activations(x, 32)
    n = packed.shape[0]
    codes = unpack_int4(packed).float().reshape(n, -1, 32)
    w = (codes * scales.float()[..., None] + lows.float()[..., None]).reshape(n, -1)
    return _combine(x, q, d, rows, w, bias)


TILE = 4  # output rows the kernels read together: their weights interleave into one sequential stream


def tile(t: torch.Tensor, piece: int) -> torch.Tensor:
    """(N, L) -> the same shape with each tile of 4 rows interleaved in pieces of `piece` elements."""
    n, length = t.shape
    return t.reshape(n // TILE, TILE, length // piece, piece).transpose(1, 2).contiguous().reshape(n, length)


def untile(t: torch.Tensor, piece: int) -> torch.Tensor:
    n, length = t.shape
    return t.reshape(n // TILE, length // piece, TILE, piece).transpose(1, 2).contiguous().reshape(n, length)
