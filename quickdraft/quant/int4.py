"""int4 weight-only linear layers (group-wise asymmetric, bf16 activations in and out).

Weights are quantized once at load, in groups of GROUP input features: q = round((w - lo) / s) in 0..15
with (s, lo) fitted to each group (`fit`), so w ~ q s + lo; a GGUF file's Q4_0 / Q4_1 / Q4_K blocks give their
own codes and grids instead (`Grid`, weights/dequant.four_bit_grid), nothing fitted. Three kernels:
- quickdraft's own (quant/vnni.py, AVX-512 VNNI CPUs): codes packed two to a byte with float16 s and lo,
  activations quantized per row to int8 and multiplied as bytes: one row at memory speed;
- on CUDA, PyTorch's `_weight_int4pack_mm` (tinygemm, quant/gpu.py), with bf16 s and zero = lo + 8 s;
- PyTorch's `_weight_int4pack_mm_for_cpu` on other CPUs, the same layout as on CUDA: its CPU twin.
`dequantized()` gives the weight the kernel multiplies by: the plain reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.quant import gpu, vnni

GROUP = 32
INNER_K_TILES = 2


def supported(weight, device=None) -> bool:
    """The kernels' shape rules on `device` (the weight's own by default): on the CPU whole groups along K and
    whole blocks of 16 output rows; on CUDA tinygemm's (quant/gpu.int4_supported)."""
    n, k = weight.shape
    device = torch.device(device) if device is not None else weight.device
    if device.type == "cuda":
        return gpu.int4_supported(n, k)
    return device.type == "cpu" and k % GROUP == 0 and n % 16 == 0


def tinygemm_layout(device) -> bool:
    """Whether int4 layers on device take tinygemm's layout (CUDA, or PyTorch's CPU twin where quickdraft's VNNI
    kernels do not run): there a GGUF file's 4-bit blocks become the layer's codes and grids as they are."""
    return torch.device(device).type == "cuda" or not vnni.available()


@dataclass
class Grid:
    """A weight already on 4-bit grids, rows at a time: rows(i, j, device) -> (codes uint8 (j - i, K) in 0..15,
    scale, lo: float32 (j - i, K / GROUP)) on device, with w = q scale + lo (a GGUF file's 4-bit blocks:
    gguf.FileRows.grid)."""

    shape: torch.Size
    rows: object

REFINE = 3  # least-squares refinements of each group's grid
MIN_SPAN = 11  # fewest steps between a group's min and max tried


def _codes(w, scale, lo):
    return ((w - lo) / scale).round().clamp(0, 15)


def _sq_error(w, scale, lo):
    return ((_codes(w, scale, lo) * scale + lo - w) ** 2).sum(-1, keepdim=True)


def fit(w: torch.Tensor, steps: int = REFINE) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's grid (scale, lo) for w (..., GROUP): from its min and max, the best of 15 down to
    MIN_SPAN steps between them, then `steps` rounds of the least-squares (scale, lo) for the current
    codes, kept where they lower the error. The GGUF files' 4-bit blocks lie on grids that min-max over
    15 steps misses whenever a block's codes do not span 0..15."""
    if w.device.type == "cpu" and vnni.available():  # the same in C++, much faster
        scale, lo = vnni.ops().int4_fit(w.contiguous(), steps)
        return scale.reshape(*w.shape[:-1], 1), lo.reshape(*w.shape[:-1], 1)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    err = _sq_error(w, scale, lo)
    for span in range(14, MIN_SPAN - 1, -1):  # a block whose codes span fewer steps
        s = ((hi - lo) / span).clamp_min(1e-8)
        e = _sq_error(w, s, lo)
        scale, err = torch.where(e < err, s, scale), torch.minimum(e, err)
    mean_w = w.mean(-1, keepdim=True)
    for _ in range(steps):
        q = _codes(w, scale, lo)
        mean_q = q.mean(-1, keepdim=True)
        var = ((q - mean_q) ** 2).mean(-1, keepdim=True)
        cov = ((q - mean_q) * (w - mean_w)).mean(-1, keepdim=True)
        new_scale = torch.where(var > 0, cov / var.clamp_min(1e-12), scale).clamp_min(1e-8)
        new_lo = mean_w - new_scale * mean_q
        new_err = _sq_error(w, new_scale, new_lo)
        better = new_err < err
        scale, lo, err = (torch.where(better, a, b) for a, b in ((new_scale, scale), (new_lo, lo), (new_err, err)))
    return scale, lo


def quantize(weight: torch.Tensor, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (codes uint8 (N, K) in 0..15, s (N, K / GROUP), lo (N, K / GROUP)), s and lo in
    dtype; the codes are rounded against s and lo as stored."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    scale, lo = fit(w)
    scale, lo = scale.to(dtype).float().clamp_min(1e-8), lo.to(dtype).float()
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, scale[..., 0].to(dtype), lo[..., 0].to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Codes q (N, K) on their grids (scale, lo: (N, K / GROUP)) -> the float32 weight q s + lo."""
    n = q.shape[0]
    return (q.reshape(n, -1, GROUP).float() * scale.float()[..., None] + lo.float()[..., None]).reshape(n, -1)


ROWS = 1024  # rows quantized and packed at a time: a vocabulary-sized head never has float32 copies in full


class Int4Linear(nn.Module):
    format = "int4"

    def __init__(self, weight, bias: torch.Tensor | None, device=None):
        """weight: (N, K) float rows (a tensor, or anything that gives them by slicing) or a Grid; the layer's
        buffers are made on `device` (the CPU by default), ROWS rows at a time."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        device = torch.device(device or "cpu")
        self.on_cuda = device.type == "cuda"
        # a Grid keeps its codes, in tinygemm's layout: on CUDA, or on its CPU twin
        self.vnni = (not self.on_cuda and not isinstance(weight, Grid) and vnni.available()
                     and self.in_features % 128 == 0)  # out_features % 16 == 0: whole tiles
        packed, scales, lows = [], [], []
        for i in range(0, self.out_features, ROWS):  # ROWS % 64 == 0: blocks pack independently
            j = min(i + ROWS, self.out_features)
            if self.on_cuda:
                q, sz = _tinygemm_grid(weight, i, j, device)
                packed.append(gpu.int4_pack(q))
                scales.append(sz)
            elif isinstance(weight, Grid):
                q, sz = _tinygemm_grid(weight, i, j, device)
                packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES))
                scales.append(sz)
            elif self.vnni:
                q, s, lo = quantize(weight[i:j], torch.float16)
                packed.append(vnni.tile(vnni.pack_int4(q), 64))
                scales.append(vnni.tile(s, 4))
                lows.append(lo)
            else:
                q, s, lo = quantize(weight[i:j])
                packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES))
                scales.append(torch.stack([s, lo + 8 * s], dim=-1).transpose(0, 1))  # (K / GROUP, n, 2)
        self.register_buffer("packed", torch.cat(packed))
        if self.vnni:
            self.register_buffer("scales", torch.cat(scales))
            self.register_buffer("lows", torch.cat(lows))
        else:
            self.register_buffer("scales_and_zeros", torch.cat(scales, dim=1).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(device, torch.bfloat16), requires_grad=False)

    @staticmethod
    def nbytes_for(n: int, k: int, device: torch.device) -> int:
        """Bytes of an (n, k) weight as this layer holds it, on every device: codes two to a byte and a 2-byte scale
        and a 2-byte low (or zero) per group."""
        return n * k // 2 + (k // GROUP) * n * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.vnni:
            out = vnni.ops().int4_linear(x2.contiguous(), self.packed, self.scales, self.lows, self.bias)
        elif self.on_cuda:  # a short pass as ROW_TILE rows (one tile): each row's result whatever the pass
            rows = x2.shape[0]
            padded = F.pad(x2, (0, 0, 0, gpu.ROW_TILE - rows)) if rows < gpu.ROW_TILE else x2
            out = gpu.int4_mm(padded.contiguous(), self.packed, self.scales_and_zeros)[:rows]
            if self.bias is not None:
                out = out + self.bias
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_and_zeros)
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def fused_operands(self) -> tuple[list[torch.Tensor], int] | None:
        """This layer's part of a fused layer step (csrc/kernels.cpp block_step): its tensors and kind; None off
        quickdraft's kernel."""
        if not self.vnni:
            return None
        bias = torch.empty(0, dtype=torch.bfloat16) if self.bias is None else self.bias
        return [self.packed, self.scales, self.lows, bias], 4

    def dequantized(self, q: torch.Tensor | None = None) -> torch.Tensor:
        """The weight the kernel multiplies by: the plain reference. PyTorch's packing is opaque, so on
        its CPU kernel the codes q (N, K) are passed in; on CUDA (or on its CPU kernel without them) the kernel itself
        multiplies the identity (each weight (q - 8) s + z as the kernel forms it, rounded to bf16)."""
        n = self.out_features
        if self.on_cuda or (q is None and not self.vnni):
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            if self.on_cuda:
                return gpu.int4_mm(eye, self.packed, self.scales_and_zeros).t().float()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros)
            return out.t().float()
        if self.vnni:
            q = vnni.unpack_int4(vnni.untile(self.packed, 64))
            scale, lo = vnni.untile(self.scales, 4).float(), self.lows.float()
        else:
            sz = self.scales_and_zeros.float()  # (K / GROUP, N, 2)
            scale, lo = sz[..., 0].t(), sz[..., 1].t() - 8 * sz[..., 0].t()
        return dequantize(q.reshape(n, self.in_features), scale, lo)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What forward computes, in plain PyTorch (on PyTorch's kernel, this needs the vnni path)."""
        assert self.vnni, "the reference of PyTorch's packed layout needs the codes: use dequantized(q)"
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = vnni.int4_reference(x2, vnni.untile(self.packed, 64), vnni.untile(self.scales, 4), self.lows, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _tinygemm_grid(weight, i: int, j: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows i:j of weight on `device` as tinygemm takes them: codes (j - i, K) and (K / GROUP, j - i, 2) bf16
    (scale, zero). A Grid keeps its codes (the file's: the weight is exactly q s + lo up to the bf16 rounding of
    s and zero); float rows are fitted on the device, and their codes rounded against the grid as stored."""
    if isinstance(weight, Grid):
        q, scale, lo = weight.rows(i, j, device)
        return q, gpu.scales_and_zeros(scale, lo)
    w = weight[i:j].to(device).float()
    groups = w.reshape(j - i, -1, GROUP)
    scale, lo = fit(groups)
    sz = gpu.scales_and_zeros(scale[..., 0], lo[..., 0])  # (K / GROUP, n, 2)
    s, z = sz[..., 0].t().float().clamp_min(1e-8)[..., None], sz[..., 1].t().float()[..., None]
    q = ((groups - z) / s + 8).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(j - i, -1), sz
