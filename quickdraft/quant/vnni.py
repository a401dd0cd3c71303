"""quickdraft's own CPU kernels (csrc/kernels.cpp over csrc/simd.h), built on first use for this CPU's instruction
set, and their plain references.

PyTorch's weight-only CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) multiply in floating
point, converting every weight for every row of activations: they stay well below the memory bandwidth for one
row, and their cost grows about linearly with the rows. These kernels quantize the activations (int8, one scale
per row) and multiply bytes (`vpdpbusd` with AVX-512 VNNI, 64 products an instruction; `vpmaddubsw` with AVX2, 32),
so one row runs near memory speed and verifying k+1 rows reads the weights once (docs/performance.md, "quickdraft's CPU
kernels", has the figures). The extension also holds the attention of decode and verification passes
(`decode_attention`: each row alone, batch invariant, in one call instead of one SDPA call per row), the fused norm,
rotary and SiLU steps, and the int4 grid fit (`int4_fit`).

One source, two builds: AVX-512 VNNI (`quickdraft_vnni`) where the CPU has it, else AVX2 + FMA + F16C
(`quickdraft_avx2_int`: every x86-64 CPU since 2013). Both give the same bits for every op (integer sums are exact,
and every float operation runs on 16-lane vectors in one order: csrc/simd.h), so a model's output does not depend on
which of them runs. `QUICKDRAFT_ISA=avx2` runs the AVX2 build on a CPU that has both (the tests and benchmarks of that
path); `QUICKDRAFT_NO_VNNI=1` turns both off. Where the CPU lacks the instructions or the build fails,
`unavailable_reason()` says why and the layers use PyTorch's ops instead. The names here keep "vnni" for the
kernels' tiled layout and family, whichever build runs them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from quickdraft.quant import extension
from quickdraft.quant.extension import Extension

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
HEADERS = (Path(__file__).parent / "csrc" / "simd.h",)
COMMON = ["-O3", "-mf16c", "-mfma", "-ffp-contract=off", "-fopenmp"]
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *COMMON]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
AVX2_FLAGS = ["-mavx2", "-mbmi2", *COMMON]
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")

OFF = "QUICKDRAFT_NO_VNNI"
BUILDS = {  # the instruction set -> its build, best first
    "avx512-vnni": Extension("quickdraft_vnni", SOURCE, FLAGS, CPU_FLAGS, OFF, HEADERS),
    "avx2": Extension("quickdraft_avx2_int", SOURCE, AVX2_FLAGS, AVX2_CPU_FLAGS, OFF, HEADERS),
}
NAMES = {"avx512-vnni": "AVX-512 VNNI", "avx2": "AVX2"}
cpu_flags = extension.cpu_flags


@functools.cache  # read once: every layer's call asks
def isa() -> str:
    """The instruction set whose build runs here: QUICKDRAFT_ISA where set (avx2 or avx512-vnni), else the best this
    CPU has (a CPU with neither: avx2, whose reason then says what it lacks)."""
    forced = os.environ.get("QUICKDRAFT_ISA", "").strip().lower()
    if forced:
        if forced not in BUILDS:
            raise ValueError(f"QUICKDRAFT_ISA={forced}: one of {', '.join(BUILDS)}")
        return forced
    have = cpu_flags()
    return next((name for name, build in BUILDS.items() if all(f in have for f in build.needs)), "avx2")


def kernels() -> Extension:
    return BUILDS[isa()]


def ops():
    """The chosen build's operators (torch.ops.quickdraft_vnni or torch.ops.quickdraft_avx2_int), built and loaded."""
    return _ops(isa())


@functools.cache
def _ops(name: str):
    reason = BUILDS[name].reason()
    if reason is not None:
        raise RuntimeError(f"quickdraft's {NAMES[name]} kernels do not run here: {reason}")
    return getattr(torch.ops, BUILDS[name].prefix)


def isa_name() -> str:
    """The chosen build as a user reads it: "AVX-512 VNNI" or "AVX2"."""
    return NAMES[isa()]


def extension_name() -> str:
    return kernels().name()


def build_lock_path() -> Path | None:
    return kernels().lock_path()


def _build_lock():
    return kernels().lock()


def available() -> bool:
    return kernels().reason() is None


def unavailable_reason() -> str | None:
    return kernels().reason()


OUTLIER_RATIO = 100.0  # as kOutlierRatio in csrc/kernels.cpp


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
