"""A denser int4, measured before it was built (built later, and slower: docs/performance.md): each group's scale
and low as 8-bit codes times a scale per block of 8 groups (256 weights), 4.625 bits a weight against today's 5 (an
fp16 scale and low per 32). Prints the weights' squared error against a GGUF file's own (its Q4_K tensors
dequantized), for today's fp16 grids and for the coded ones, with each block's scale chosen two ways: its largest
value over 255 (or 127), and the largest divisor up to 255 (or 127) of which all 8 values are whole multiples and which
is exact in fp16 (what a Q4_K block's d over a power of two is).
docs/measurements/2026.md (2026-12-06: a denser int4 format, measured and not kept) has its figures.

    python scripts/check_int4_codes.py [--model qwen2.5-coder-1.5b] [--every 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import dequantize

from quickdraft.quant import int4
from quickdraft.weights import gguf as gguf_io, hub

BLOCK = 8  # groups of 32 per block scale


def naive(v: torch.Tensor, cmax: int) -> torch.Tensor:
    """v (n, blocks, 8) as codes times each block's largest |value| / cmax (bf16)."""
    s = (v.abs().amax(-1, keepdim=True) / cmax).bfloat16().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (v / s).round().clamp(-cmax if (v < 0).any() else 0, cmax) * s


def matched(v: torch.Tensor, cmax: int) -> tuple[torch.Tensor, float]:
    """v (n, blocks, 8) as codes times each block's scale m / c: c the largest up to cmax with every value a whole
    multiple of m / c (within 2e-3 of a step) and m / c exact in fp16; cmax where none is. Also the share matched."""
    m = v.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    best, found = torch.full_like(m, float(cmax)), torch.zeros_like(m, dtype=torch.bool)
    for c in range(cmax, 0, -1):
        r = v / m * c
        exact = ((m / c).half().float() * c - m).abs() <= 1e-6 * m
        ok = ((r - r.round()).abs().amax(-1, keepdim=True) < 2e-3) & exact & ~found
        best, found = torch.where(ok, torch.full_like(m, float(c)), best), found | ok
    s = (m / best).half().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (v / s).round().clamp(-cmax, cmax) * s, float(found.float().mean())


def sq_error(g: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> float:
    scale = scale.clamp_min(1e-12)
    q = ((g - lo) / scale).round().clamp(0, 15)
    return float(((q * scale + lo - g) ** 2).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--every", type=int, default=4, help="layers 1, 1 + every, ... (1: all)")
    args = ap.parse_args()
    reader = gguf_io.open_gguf(hub.pull(args.model))
    totals = {"fp16 grids (today)": 0.0, "coded, naive block scale": 0.0, "coded, matched block scale": 0.0}
    shares, count, t0 = [], 0, time.perf_counter()
    for t in reader.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        if t.tensor_type.name != "Q4_K" or layer < 0 or layer % args.every != 1 % args.every:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        g = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32)).reshape(n, k // 32, 32)
        scale, lo = int4.fit(g)
        groups = k // 32
        blocks = -(-groups // BLOCK)
        totals["fp16 grids (today)"] += sq_error(g, scale.half().float(), lo.half().float())

        def by_block(x):
            return F.pad(x[..., 0], (0, blocks * BLOCK - groups)).reshape(n, blocks, BLOCK)

        def back(x):
            return x.reshape(n, -1)[:, :groups, None]

        naive_s, naive_l = naive(by_block(scale), 255), naive(by_block(lo), 127)
        totals["coded, naive block scale"] += sq_error(g, back(naive_s), back(naive_l))
        s, share_s = matched(by_block(scale), 255)
        l, share_l = matched(by_block(lo), 127)
        totals["coded, matched block scale"] += sq_error(g, back(s), back(l))
        shares.append((share_s, share_l))
        count += 1
    base = totals["fp16 grids (today)"]
    print(f"{args.model}: {count} Q4_K tensors (layers 1, {1 + args.every}, ...), {time.perf_counter() - t0:.0f} s; "
          "squared error against the file's weights:")
    for name, total in totals.items():
        print(f"  {name:28s} {total:.4e}  ({total / base:.3f}x today's)")
    print(f"  blocks matched: scales {min(s for s, _ in shares):.4f}-{max(s for s, _ in shares):.4f}, "
          f"lows {min(x for _, x in shares):.4f}-{max(x for _, x in shares):.4f} (per tensor)")


if __name__ == "__main__":
    main()
