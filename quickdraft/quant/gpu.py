"""The weight formats' kernels on CUDA (bf16 activations in and out), each beside its plain reference.

- int4: PyTorch's own `_weight_int4pack_mm` (the tinygemm kernel gpt-fast and torchao use): codes packed by
  `_convert_weight_to_int4pack`, one bf16 (scale, zero) pair per group of GROUP inputs, w = (q - 8) s + z; the
  same layout as its CPU twin `_weight_int4pack_mm_for_cpu`, which the CPU tests run.
- int8: a Triton kernel of ours (`int8_mm`), per output row one bf16 scale. PyTorch's `_weight_int8pack_mm` on
  CUDA gives one warp to each (row of activations, output) pair, so a pass of r rows reads the weights r times: a
  padded verification pass (runtime/graphs.py: 17 rows) would read 17 times the bytes of a step. Ours reads each
  weight tile once for up to 64 rows, and splits K in a fixed number of slices (from the shapes only, never
  from the rows), summed in a fixed order: a row's result does not depend on the other rows. Without Triton,
  PyTorch's kernel runs (correct, slower), and doctor says so.

Triton's interpreter (TRITON_INTERPRET=1) runs the Triton kernel on CPU tensors, which is how CI tests it.
"""

from __future__ import annotations

import functools
import os

import torch

GROUP = 32  # inputs per int4 (scale, zero) pair: a GGUF Q4 block
BLOCK_N, BLOCK_K = 64, 128


@functools.cache
def triton_reason() -> str | None:
    """None where the Triton kernel can run (Triton imports, and a GPU or the interpreter is there), else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return "no CUDA device"
    return None


def inner_k_tiles(k: int) -> int | None:
    """The tinygemm packing's inner K tiles for K inputs (its rule: K a multiple of 16 of them), None where
    none fits."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def int4_supported(n: int, k: int) -> bool:
    """tinygemm's shape rules: whole groups and K tiles along K, whole tiles of 8 outputs."""
    return k % GROUP == 0 and inner_k_tiles(k) is not None and n % 8 == 0


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in 0..15 on the GPU -> tinygemm's packed tensor (two codes a byte, even index high)."""
    c = codes.to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack((c[:, 0::2] << 4) | c[:, 1::2], inner_k_tiles(codes.shape[1]))


def scales_and_zeros(scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Each group's grid (scale, lo: (N, K / GROUP), w = q scale + lo for q in 0..15) -> tinygemm's (K / GROUP,
    N, 2) bf16 (scale, zero) with w = (q - 8) scale + zero: zero = lo + 8 scale, computed in float32 and rounded
    once."""
    s = scale.float()
    return torch.stack([s, lo.float() + 8 * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)


def int8_splits(n: int, k: int) -> int:
    """Slices of K each output tile is split into: enough programs to fill the GPU (two per multiprocessor)
    when N alone gives too few, at least BLOCK_K inputs a slice. From the shapes only: the same for every pass."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    tiles = -(-n // BLOCK_N)
    return max(1, min(-(-2 * sms // tiles), k // BLOCK_K, 16))


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            splits: int) -> torch.Tensor:
    """x (M, K) bf16 times int8 q (N, K) with per-row scales (N,) float32 -> (M, N) bf16, on the Triton kernel."""
    kernel = _int8_kernel()
    m, k = x.shape
    n = q.shape[0]
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    per_split = -(-k // (splits * BLOCK_K)) * BLOCK_K
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (-(-n // BLOCK_N), -(-m // block_m), splits)
    kernel[grid](x, q, partial, m, n, k, per_split, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                 FLOAT32_DOT=not x.is_cuda)
    out = (partial.sum(0) if splits > 1 else partial[0]) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """What int8_mm computes, in plain PyTorch (float32)."""
    out = (x.float() @ q.float().t()) * scale.float()
    return (out + bias.float() if bias is not None else out).to(torch.bfloat16)


@functools.cache
def _int8_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, w, out, M, N, K, per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, per_split, BLOCK_K):  # slices never overlap: per_split is a whole number of blocks
            rk = pid_k * per_split + k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(w + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0)
            if FLOAT32_DOT:  # Triton's interpreter (CPU tensors) multiplies bf16 operands wrongly
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                acc += tl.dot(a, b.to(tl.bfloat16))  # int8 codes are exact in bf16
        tl.store(out + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return kernel
