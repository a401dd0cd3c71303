"""The weight formats' kernels on CUDA (bf16 activations in and out), each beside its plain reference.

- int4: PyTorch's own `_weight_int4pack_mm` (the tinygemm kernel gpt-fast and torchao use): codes packed by
  `_convert_weight_to_int4pack`, one bf16 (scale, zero) pair per group of GROUP inputs, w = (q - 8) s + z; the
  same layout as its CPU twin `_weight_int4pack_mm_for_cpu`, which the CPU tests run.
- int8: a Triton kernel of ours (`int8_mm`), per output row one bf16 scale. PyTorch's `_weight_int8pack_mm` on
  CUDA gives one warp to each (row of activations, output) pair, so a pass of r rows reads the weights r times: a
  padded verification pass (runtime/graphs.py: 16 rows) would read 16 times the bytes of a step. Ours reads each
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
    """None where the Triton kernel runs here (Triton imports, and a first launch on the GPU compiles and gives
    the reference's result; or the interpreter is on), else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:  # compiling needs a C compiler for the launcher too: a failure here is a fallback, not a crash later
        x = torch.ones(2, 64, dtype=torch.bfloat16, device="cuda")
        q = torch.ones(64, 64, dtype=torch.int8, device="cuda")
        got = int8_mm(x, q, torch.ones(64, device="cuda"), None, 1)
        if not torch.equal(got.float(), torch.full((2, 64), 64.0, device="cuda")):
            return "its first launch gave a wrong result"
    except Exception as e:  # noqa: BLE001: any failure means PyTorch's kernel runs instead
        return f"its first launch failed ({type(e).__name__}: {str(e)[:200]})"
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


def int8_splits(n: int, k: int, device=None) -> int:
    """Slices of K each output tile is split into for passes of up to DECODE_ROWS rows: enough programs to fill the
    GPU (two per multiprocessor) when N alone gives too few, at least BLOCK_K inputs a slice, and none of them empty
    (the count is taken again once the slice size is rounded up to whole blocks). From the shapes only: the same for
    every such pass."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    sms = torch.cuda.get_device_properties(device or 0).multi_processor_count if cuda else 132
    tiles = -(-n // BLOCK_N)
    return int8_slices(k, max(1, min(-(-2 * sms // tiles), k // BLOCK_K, 16)))[0]


def int8_slices(k: int, splits: int) -> tuple[int, int]:
    """(slices, inputs per slice) when K is cut into at most `splits` slices of whole BLOCK_K blocks: the slice size
    rounded up, then only as many slices as it takes to cover K (rounding up can leave the last ones empty)."""
    per_split = -(-k // (splits * BLOCK_K)) * BLOCK_K
    return -(-k // per_split), per_split


ROW_TILE = 16  # rows of tinygemm's tiles: CUDA passes of up to this many rows are computed as this many
#               (runtime/graphs.WIDTH; LoadedModel.forward's eager passes; models.transformer.linear)


DECODE_ROWS = 32  # passes of up to this many rows (steps, verifications, the padded graph pass) share one shape


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            splits: int) -> torch.Tensor:
    """x (M, K) bf16 times int8 q (N, K) with per-row scales (N,) float32 -> (M, N) bf16, on the Triton kernel.

    Passes of up to DECODE_ROWS rows run one tile of DECODE_ROWS rows with K in `splits` slices (float32 partial
    sums added in a fixed order): every row computed the same way whatever the pass. Longer passes (a prefill) run
    tiles of 64 rows, K whole, scaled and rounded in the kernel."""
    kernel = _int8_kernel()
    m, k = x.shape
    n = q.shape[0]
    decode = m <= DECODE_ROWS
    block_m, splits = (DECODE_ROWS, splits) if decode else (64, 1)
    splits, per_split = int8_slices(k, splits)
    grid = (-(-n // BLOCK_N), -(-m // block_m), splits)
    common = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, FLOAT32_DOT=not x.is_cuda)
    if splits == 1:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        kernel[grid](x, q, out, scale, bias if bias is not None else scale, m, n, k, per_split, FINAL=True,
                     HAS_BIAS=bias is not None, **common)
        return out
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    kernel[grid](x, q, partial, scale, scale, m, n, k, per_split, FINAL=False, HAS_BIAS=False, **common)
    out = partial.sum(0) * scale
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
    def kernel(x, w, out, scale, bias, M, N, K, per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, FLOAT32_DOT: tl.constexpr, FINAL: tl.constexpr, HAS_BIAS: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit offsets: a long prefill's M * K
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, per_split, BLOCK_K):  # slices never overlap: per_split is a whole number of blocks
            rk = pid_k * per_split + k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(w + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0)
            if FLOAT32_DOT:  # Triton's interpreter (CPU tensors) multiplies bf16 operands wrongly
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
            else:
                acc += tl.dot(a, b.to(tl.bfloat16))  # int8 codes are exact in bf16
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if FINAL:  # the whole K: scale, bias, round to bf16 here
            acc = acc * tl.load(scale + rn, mask=rn < N, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)
        else:
            tl.store(out + pid_k.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)

    return kernel
