"""quickdraft's float32 CPU kernels (csrc/avx2.cpp: AVX2 and FMA, so any x86-64 CPU since 2013), built on first
use, and their plain references.

A float32 model's linear layers and FFN activations on PyTorch's operators give a row different bits in a one-token
step than in a verification pass of several rows, or with another thread count (MKL's GEMM and PyTorch's vectorised
elementwise kernels choose their order by the shapes and the threads): speculation would change logprobs and, at
near ties, tokens. These kernels fix every output's order of operations (csrc/avx2.cpp says how), so a row's result
is the same whatever the rows beside it and the threads sharing the work. Where the CPU lacks AVX2 or the build
fails, `unavailable_reason()` says why and the layers use PyTorch's ops (row-invariant then only in bf16).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft.quant.extension import Extension

SOURCE = Path(__file__).parent / "csrc" / "avx2.cpp"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
KERNELS = Extension("quickdraft_avx2", SOURCE, FLAGS, ("avx2", "fma", "f16c"), "QUICKDRAFT_NO_AVX2")
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # act_mul's kind


def available() -> bool:
    return KERNELS.reason() is None


def unavailable_reason() -> str | None:
    return KERNELS.reason()


def linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `linear_f32` computes, up to its order of summation."""
    return F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()


def act_mul_reference(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """What `act_mul` computes, in PyTorch's ops (equal up to the last bits of exp)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
