#!/usr/bin/env python
"""The CUDA benchmark that scripts/gpu_check.sh runs: plain decoding of the 1.5B target and of the 0.5B
draft against the memory roofline, and v(k) for k = 1..16.

The models are the default pair when their GGUF files are in the cache (`quickdraft pull`), else random
weights of exactly their shapes (a GPU machine without network has no models; a pass's speed depends on
the shapes, not the values). Decoding is timed three ways: eager (each kernel launched from Python) and
replaying CUDA graphs (runtime/graphs.py: what the engine does on CUDA), each with every token's argmax
read back to the host before the next step (as the engine does); and graphs with the next token kept on
the device (no host sync). Prints one table last.

Usage: python scripts/gpu_bench.py [-n 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft import roofline
from quickdraft.config import EngineConfig, ModelConfig
from quickdraft.models.transformer import Transformer
from quickdraft.runtime.graphs import StepGraphs
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.plan import plan
from quickdraft.weights import hub
from quickdraft.weights.loader import LoadedModel, load_model

SHAPES = {  # the default pair's shapes (MODELS.md), for random weights
    hub.DEFAULT_TARGET: ModelConfig("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, 1e-6, 1e6, 32768, qkv_bias=True),
    hub.DEFAULT_DRAFT: ModelConfig("qwen2", 151936, 896, 24, 14, 2, 64, 4864, 1e-6, 1e6, 32768, qkv_bias=True),
}


def load(alias: str, device: torch.device, context: int) -> tuple[LoadedModel, str]:
    if hub.is_pulled(alias):
        return load_model(alias, EngineConfig(device=str(device), dtype="bfloat16", max_context=context), False), \
            "real weights"
    cfg = SHAPES[alias]
    with torch.device(device):
        model = Transformer(cfg, context).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    model.set_rotary(context, device)
    model = model.eval().requires_grad_(False)
    graphs = StepGraphs(model) if device.type == "cuda" else None
    return LoadedModel(alias, Path(alias), cfg, model, None, 0.0, plan=plan(model), graphs=graphs), "random weights"


@torch.inference_mode()
def decode_tok_s(lm: LoadedModel, n: int, host_sync: bool, graphs: bool, prompt_len: int = 64) -> float:
    saved = lm.graphs
    lm.graphs = saved if graphs else None
    try:
        return _decode_tok_s(lm, n, host_sync, prompt_len)
    finally:
        lm.graphs = saved


def _decode_tok_s(lm: LoadedModel, n: int, host_sync: bool, prompt_len: int) -> float:
    device = lm.device
    cache = KVCache.for_model(lm.model, prompt_len + n + 32)  # room for a graph's padded rows at every step
    prompt = torch.randint(0, 1000, (1, prompt_len), device=device)
    token = lm.forward(prompt, cache, last_only=True)[0, -1].argmax().reshape(1, 1)
    for _ in range(4):  # warm-up steps, then back to the prompt
        lm.forward(token, cache, last_only=True)
    cache.rollback(prompt_len)
    roofline.sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = lm.forward(token, cache, last_only=True)
        token = logits[0, -1].argmax().reshape(1, 1)
        if host_sync:
            token = torch.tensor([[int(token)]], device=device)
    roofline.sync(device)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=256, help="tokens decoded per timing (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: PyTorch sees no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = roofline.bandwidth(device)
    print(f"gpu_bench: {name}, torch {torch.__version__}, bandwidth {bw / 1e9:.0f} GB/s (copy/read, measured now)",
          file=sys.stderr)
    rows, v = [], {}
    for alias in (hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT):
        lm, source = load(alias, device, 1024)
        per_pass = roofline.pass_bytes(lm.model, 64 + args.n // 2)
        eager = statistics.median(decode_tok_s(lm, args.n, True, False) for _ in range(args.runs))
        sync = statistics.median(decode_tok_s(lm, args.n, True, True) for _ in range(args.runs))
        free = statistics.median(decode_tok_s(lm, args.n, False, True) for _ in range(args.runs))
        graphs = lm.graphs
        if graphs is not None and graphs.disabled:
            print(f"gpu_bench: CUDA graphs off for {alias}: {graphs.disabled}", file=sys.stderr)
        limit = bw / per_pass
        rows.append((f"{alias} ({source})", per_pass / 1e6, eager, sync, free, limit))
        if alias == hub.DEFAULT_TARGET:
            prompt = torch.randint(0, 1000, (64,)).tolist()
            t1, v = roofline.v_curve(lm, prompt, 16)
        del lm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'model (bf16), tok/s':44} {'MB/pass':>8} {'eager':>7} {'graphs':>7} {'no sync':>8} {'limit':>7} "
          f"{'% eager':>7} {'% graphs':>8} {'% no sync':>9}")
    for label, mb, eager, sync, free, limit in rows:
        print(f"{label:44} {mb:8.0f} {eager:7.1f} {sync:7.1f} {free:8.1f} {limit:7.0f} {100 * eager / limit:6.0f}% "
              f"{100 * sync / limit:7.0f}% {100 * free / limit:8.0f}%")
    print("v(k) of the target (graphs: every pass of up to 17 tokens is padded to 17 rows): "
          + ", ".join(f"{k}: {x:.2f}" for k, x in v.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
