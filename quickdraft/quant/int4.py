"""int4 weight-only linear layers on PyTorch's CPU kernel (group-wise asymmetric, bf16 activations).

Weights are quantized once at load, in groups of GROUP input features: q = round((w - min) / s) in
0..15 with s = (max - min) / 15, stored packed two to a byte; the kernel computes x @ W^T with
W = (q - 8) * s + zero, zero = min + 8 s. `dequantized()` gives that W, the plain reference the kernel
is tested against. One row costs about half the bf16 time (half the bytes), which is what a draft model,
decoding one token at a time, spends its time on.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32
INNER_K_TILES = 2


def supported(weight: torch.Tensor) -> bool:
    """The CPU kernel's shape rules: whole groups along K, whole blocks of 16 output rows."""
    n, k = weight.shape
    return weight.device.type == "cpu" and k % GROUP == 0 and n % 16 == 0


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q int32 (N, K) in 0..15, scales_and_zeros bf16 (K / GROUP, N, 2))."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q, scales_and_zeros


ROWS = 4096  # rows quantized and packed at a time: a vocabulary-sized head never has float32 copies in full


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed, sz = [], []
        for i in range(0, self.out_features, ROWS):  # blocks of 64 rows pack independently: ROWS % 64 == 0
            q, chunk_sz = quantize(weight[i:i + ROWS])
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES))
            sz.append(chunk_sz)
        self.register_buffer("packed", torch.cat(packed))
        self.register_buffer("scales_and_zeros", torch.cat(sz, dim=1))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(torch.bfloat16), self.packed, GROUP, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self, q: torch.Tensor) -> torch.Tensor:
        """The weight the kernel multiplies by, from the int32 codes q (N, K): the plain reference."""
        sz = self.scales_and_zeros.float()  # (K / GROUP, N, 2)
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # (N, K / GROUP)
        w = (q.reshape(self.out_features, -1, GROUP).float() - 8) * scale[..., None] + zero[..., None]
        return w.reshape(self.out_features, self.in_features)
