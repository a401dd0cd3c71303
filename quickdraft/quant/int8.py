"""int8 weight-only linear layers (bf16 activations in and out).

Weights are quantized once at load, per output row, symmetric: q = round(w / s) in -127..127 with
s = max |w| / 127, about 0.4% of a row's largest weight as the worst rounding error. Three kernels:
- quickdraft's own (quant/vnni.py, AVX-512 VNNI CPUs): the activations are quantized per row to int8
  too and multiplied as bytes, so one row reads the weights at memory speed and k+1 rows cost little more;
- on CUDA, quickdraft's Triton kernel (quant/gpu.py: bf16 activations, the weights read once for all rows);
- PyTorch's `_weight_int8pack_mm` elsewhere (float multiply, bf16 activations; on CUDA where Triton is missing).
`dequantized()` gives q s, the weight both multiply by; `vnni.int8_reference` is the first's plain reference.
"""

from __future__ import annotations

import torch
from torch import nn

from quickdraft.quant import gpu, vnni


def supported(weight, device=None) -> bool:
    """2-D, on the CPU with whole blocks of 16 inputs (PyTorch's kernel reads past the end of a row otherwise: it
    crashes the process for K = 8), on CUDA any shape."""
    device = torch.device(device) if device is not None else weight.device
    return len(weight.shape) == 2 and (device.type == "cuda" or (device.type == "cpu" and weight.shape[1] % 16 == 0))


ROWS = 4096  # rows quantized at a time: a vocabulary-sized head never has float32 copies in full


def quantize(weight, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float rows (a tensor, or anything that gives them by slicing) -> (q int8 (N, K), scales (N,) bf16),
    made on `device` (the CPU by default) ROWS rows at a time."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=device)
    scale = torch.empty(weight.shape[0], dtype=torch.bfloat16, device=device)
    for i in range(0, weight.shape[0], ROWS):
        w = weight[i:i + ROWS].to(device).float()
        scale[i:i + ROWS] = (w.abs().amax(-1) / 127).clamp_min(1e-8)  # bf16 scales, as PyTorch's kernel takes
        q[i:i + ROWS] = (w / scale[i:i + ROWS].float()[:, None]).round().clamp(-127, 127)
    return q, scale


class Int8Linear(nn.Module):
    format = "int8"

    def __init__(self, weight, bias: torch.Tensor | None, device=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        device = torch.device(device or "cpu")
        q, scale = quantize(weight, device)
        self.on_cuda = device.type == "cuda"
        self.triton = self.on_cuda and gpu.triton_reason() is None
        self.splits = gpu.int8_splits(self.out_features, self.in_features, device) if self.triton else 1
        self.vnni = self._vnni_layout(self.out_features, self.in_features, device)
        if self.on_cuda:
            self.register_buffer("q", q)
            self.register_buffer("scales", scale.float())
        elif self.vnni:  # codes + 128 as unsigned bytes, each tile of 4 rows interleaved (ROWS % TILE == 0)
            for i in range(0, self.out_features, ROWS):
                q[i:i + ROWS] = vnni.tile(q[i:i + ROWS].view(torch.uint8) ^ 128, 64).view(torch.int8)
            self.register_buffer("q", q.view(torch.uint8))
            self.register_buffer("scales", scale.float())
        else:
            self.register_buffer("q", q)
            self.register_buffer("scales", scale)
        self.bias = None if bias is None else nn.Parameter(bias.to(device, torch.bfloat16), requires_grad=False)

    @staticmethod
    def _vnni_layout(n: int, k: int, device: torch.device) -> bool:
        """Whether an (n, k) layer on device runs quickdraft's VNNI kernel (its tiled layout)."""
        return device.type == "cpu" and vnni.available() and k % 64 == 0 and n % vnni.TILE == 0

    @classmethod
    def nbytes_for(cls, n: int, k: int, device: torch.device) -> int:
        """Bytes of an (n, k) weight as this layer holds it on device: the codes and a scale per row (float32 on
        CUDA and the VNNI kernel, bf16 on PyTorch's CPU kernel)."""
        return n * k + n * (4 if device.type == "cuda" or cls._vnni_layout(n, k, device) else 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.vnni:
            out = vnni.ops().int8_linear(x2.contiguous(), self.q, self.scales, self.bias)
        elif self.triton:
            out = gpu.int8_mm(x2.contiguous(), self.q, self.scales, self.bias, self.splits)
        else:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scales)
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def fused_operands(self) -> tuple[list[torch.Tensor], int] | None:
        """This layer's part of a fused layer step (csrc/kernels.cpp block_step): its tensors and kind; None off
        quickdraft's kernel."""
        if not self.vnni:
            return None
        none = torch.empty(0, dtype=torch.bfloat16)
        return [self.q, self.scales, none, none if self.bias is None else self.bias], 8

    def codes(self) -> torch.Tensor:
        """The int8 codes q (N, K), in row order."""
        return (vnni.untile(self.q, 64) ^ 128).view(torch.int8) if self.vnni else self.q

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by: the plain reference."""
        return self.codes().float() * self.scales.float()[:, None]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What forward computes, in plain PyTorch."""
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.vnni:
            out = vnni.int8_reference(x2, vnni.untile(self.q, 64), self.scales, self.bias)
        elif self.on_cuda:
            out = gpu.int8_reference(x2, self.q, self.scales, self.bias)
        else:
            out = (x2.float() @ self.dequantized().t() + (self.bias.float() if self.bias is not None else 0))
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
