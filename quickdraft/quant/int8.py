"""int8 weight-only linear layers on PyTorch's weight-only int8 kernel (bf16 activations).

Weights are quantized once at load, per output row, symmetric: q = round(w / s) in -127..127 with
s = max |w| / 127. The kernel computes x @ (q s)^T reading one byte per weight, half the bf16 traffic,
with about 0.4% of a row's largest weight as the worst rounding error (so quality stays close to bf16).
`dequantized()` gives q s, the plain reference the kernel is tested against.
"""

from __future__ import annotations

import torch
from torch import nn


def supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2


ROWS = 4096  # rows quantized at a time: a vocabulary-sized head never has float32 copies in full


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q int8 (N, K), scales (N,) bf16)."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.bfloat16)
    for i in range(0, weight.shape[0], ROWS):
        w = weight[i:i + ROWS].float()
        scale[i:i + ROWS] = (w.abs().amax(-1) / 127).clamp_min(1e-8)  # the kernel's scales are bf16
        q[i:i + ROWS] = (w / scale[i:i + ROWS].float()[:, None]).round().clamp(-127, 127)
    return q, scale


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize(weight)
        self.register_buffer("q", q)
        self.register_buffer("scales", scale)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.q,
                                                 self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by: the plain reference."""
        return self.q.float() * self.scales.float()[:, None]
