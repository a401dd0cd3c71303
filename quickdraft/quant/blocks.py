"""GGML block formats -> float tensors, vectorised in PyTorch (one pass per tensor, no per-block loops).

Each function takes the raw bytes of a tensor as a (n_blocks, block_bytes) uint8 tensor and returns
(n_blocks, block_size) float32. The layouts are those of ggml-quants.c; `gguf.quants.dequantize`
(NumPy) is the reference they are tested against.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from quickdraft.errors import QuickdraftError


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(n, 4) little-endian bytes -> (n, 1) int32 holding the same bits."""
    return b.contiguous().view(torch.int32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32): low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 1) int32 -> (n, 32) of bit j of qh, as the 5th bit of element j."""
    shifts = torch.arange(32, dtype=torch.int32, device=qh.device)
    return ((qh >> shifts) & 1).to(torch.uint8) << 4


def _q8_0(b):
    return _f16(b[:, 0:2]) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(b):
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b):
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:20]).float() + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | _high_bits(_u32(b[:, 2:6]))
    return _f16(b[:, 0:2]) * (q.float() - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | _high_bits(_u32(b[:, 4:8]))
    return _f16(b[:, 0:2]) * q.float() + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K / Q5_K -> 8 six-bit scales and 8 six-bit mins, each (n, 8)."""
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) -> (n, 8, 32): each 32-byte chunk holds sub-block 2i in low and 2i+1 in high nibbles."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_low_nibbles(b[:, 16:144]).float()
    y = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return y.reshape(-1, 256)


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    q = _k_low_nibbles(b[:, 48:176]) | (((qh >> shifts) & 1) << 4)  # (n, 8, 32)
    y = (d * sc)[:, :, None] * q.float() - (dmin * mn)[:, :, None]
    return y.reshape(-1, 256)


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16): one scale per 16 elements
    d = _f16(b[:, 208:210])
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # (n, 2, 128)
    # made on the device (no host list copied in: a lookup of the token table runs inside captured CUDA graphs)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(-1, 2, 128)
    q = (low | (high << 4)).float() - 32
    y = (d * sc)[:, :, None] * q.reshape(-1, 16, 16)
    return y.reshape(-1, 256)


def _grid_q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _grid_q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _grid_q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _k_low_nibbles(b[:, 16:144]).reshape(-1, 32), (d * sc).reshape(-1, 1), (-dmin * mn).reshape(-1, 1)


_GRIDS = {T.Q4_0: _grid_q4_0, T.Q4_1: _grid_q4_1, T.Q4_K: _grid_q4_k}


def four_bit_grid(rows: torch.Tensor, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a Q4_0 / Q4_1 / Q4_K matrix, (n, bytes per row) uint8 on any device -> the blocks' own codes and
    grids: (codes uint8 (n, K) in 0..15, scale, lo: float32 (n, K / 32)), each group of 32 inputs exactly
    codes * scale + lo (the values `dequantize` gives, up to float32 rounding of Q4_K's d * sc products)."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    n = rows.shape[0]
    q, scale, lo = _GRIDS[qtype](rows.reshape(-1, block_bytes))
    return q.reshape(n, -1), scale.reshape(n, -1), lo.reshape(n, -1)


_BLOCK_FORMATS = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
_PLAIN_FORMATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SUPPORTED_TYPES = tuple(_PLAIN_FORMATS) + tuple(_BLOCK_FORMATS)
BLOCK_TYPES = tuple(_BLOCK_FORMATS)
FOUR_BIT_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)  # 16 levels on a grid per block of 32: what int4 holds


def _as_torch(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # memory-mapped read-only arrays: we never write into them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(a))


def dequantize(raw: np.ndarray, qtype: T, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Raw tensor data as the gguf reader gives it -> a tensor of `shape` (PyTorch order) in `dtype`."""
    if qtype in _PLAIN_FORMATS:
        data = _as_torch(raw.reshape(-1).view(np.uint8)).view(_PLAIN_FORMATS[qtype])
        return data.reshape(shape).to(dtype)
    if qtype not in _BLOCK_FORMATS:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise QuickdraftError(
            f"unsupported tensor type {qtype.name}: quickdraft reads {names}; "
            "re-quantize the model to one of these (e.g. Q4_K_M or Q8_0)"
        )
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = _as_torch(raw.reshape(-1).view(np.uint8)).reshape(-1, block_bytes)
    # in chunks, into the destination: the float32 intermediates of a whole embedding table would be GBs
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype)
    for i in range(0, blocks.shape[0], CHUNK_BLOCKS):
        out[i:i + CHUNK_BLOCKS] = _BLOCK_FORMATS[qtype](blocks[i:i + CHUNK_BLOCKS])
    return out.reshape(shape)


CHUNK_BLOCKS = 1 << 14


def dequantize_rows(rows: torch.Tensor, qtype: T, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a block-format matrix, (n, bytes per row) uint8 -> (n, row length) in dtype: the values
    `dequantize` gives those rows."""
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    return _BLOCK_FORMATS[qtype](rows.reshape(-1, block_bytes)).to(dtype).reshape(rows.shape[0], -1)
