#!/usr/bin/env python
"""Foundation figures: load time and peak memory for the default pair, plain decode tok/s of each.

Usage: .venv/bin/python scripts/bench_plain.py [--dtype auto] [--weights auto|bf16|int8|int4|mixed] [--runs 3] [-n 64] [--device auto]
Decode tok/s is measured from the first token on (prefill excluded), median of --runs after one warm-up.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch

import quickdraft
from quickdraft.cli import DEMO_PROMPT
from quickdraft.config import SamplingParams
from quickdraft.quant import FORMATS
from quickdraft.weights import hub
from quickdraft.tools.runs import Figures, machine


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def decode_runs(llm, n: int, runs: int) -> list[float]:
    prompt = llm.chat_prompt([{"role": "user", "content": DEMO_PROMPT}])
    params = SamplingParams(max_tokens=n, stop_at_eos=False)
    speeds = []
    for i in range(runs + 1):
        final = list(llm.stream(prompt, params=params))[-1]
        if i > 0:  # the first run warms up
            speeds.append(final.timings.decode_tok_s)
    return speeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--weights", default="auto", choices=FORMATS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    options = dict(device=args.device, dtype=args.dtype, weights=args.weights, context=1024, progress=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype={args.dtype}, "
          f"weights={args.weights}", file=sys.stderr)
    rows = []
    loaded = []
    for alias in (hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT):
        start = time.perf_counter()
        llm = quickdraft.load(alias, "none", **options)
        rows.append([alias, f"{time.perf_counter() - start:.1f}", str(llm.target.model.dtype)])
        loaded.append(llm)
    pair_peak = peak_rss_gib()
    figures = Figures()  # decode tok/s by model
    for row, lm in zip(rows, loaded):
        alias = row[0]
        for speed in decode_runs(lm, args.n, args.runs):
            figures.add(alias, speed)
        low, high = figures.spread(alias)
        row += [f"{figures.median(alias):.2f}", f"{low:.2f}-{high:.2f}"]
    header = ["model", "load s", "dtype", "decode tok/s (median)", "range"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"peak RSS with the pair loaded: {pair_peak:.2f} GiB; GGUF files: "
          f"{sum(hub.DEFAULT_MODELS[a].size for a in (hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT)) / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
