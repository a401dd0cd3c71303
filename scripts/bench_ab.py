#!/usr/bin/env python
"""Decode speed of two checkouts, A/B: OLD and NEW take turns (a fresh process each sample, the order swapped every
round), the default target plain and with its default draft, 128 greedy tokens on a code and a Chinese prompt;
medians and ratios, and whether both gave the same tokens. "decode" is the engine's own figure (tokens after the
first over the time from the first); "whole" is tokens over the wall time of the call, what a user waits for.

Usage: .venv/bin/python scripts/bench_ab.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 3]
       (an old revision as a worktree: git worktree add ../quickdraft-old REV)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = ["Write a Python function that checks whether a string is a palindrome, with tests.",
           "用三句话介绍长城的历史。"]
N = 128


def sample() -> dict:
    """One sample of the checkout this process imports: {case: [decode tok/s, tokens, whole tok/s]}."""
    import quickdraft

    out = {}
    for draft in ("none", "auto"):
        llm = quickdraft.load("qwen2.5-coder-1.5b", draft, progress=False)
        llm.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)  # warm-up
        for i, prompt in enumerate(PROMPTS):
            start = time.perf_counter()
            r = llm.generate(messages=[{"role": "user", "content": prompt}], max_tokens=N, temperature=0,
                             stop_at_eos=False)
            out[f"{draft}/{i}"] = [r.timings.decode_tok_s, r.tokens, len(r.tokens) / (time.perf_counter() - start)]
        del llm
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)  # a child: one sample, as JSON
    args = ap.parse_args()
    if args.sample:
        print(json.dumps(sample()))
        return 0
    # (not at the top: a sample runs an old checkout, which may lack it)
    from quickdraft.tools.runs import Figures, machine, rotated

    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    figures, tokens = Figures(), {}  # figures by (checkout, case, "decode" or "whole"); tokens by case, every sample's
    for r in range(args.rounds):
        for name, path in rotated([("old", args.old), ("new", args.new)], r):
            path = os.path.abspath(path)
            child = subprocess.run([sys.executable, os.path.abspath(__file__), path, path, "--sample"],
                                   capture_output=True, text=True, cwd=path, env={**os.environ, "PYTHONPATH": path})
            if child.returncode:
                print(child.stderr[-3000:], file=sys.stderr)
                return 1
            result = json.loads(child.stdout.strip().splitlines()[-1])
            for k, (decode, out, whole) in result.items():
                figures.add((name, k, "decode"), decode)
                figures.add((name, k, "whole"), whole)
                tokens.setdefault(k, []).append(out)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v[0]:.1f}" for k, v in result.items()),
                  file=sys.stderr, flush=True)
    print(f"{'case':10} {'decode old':>10} {'new':>7} {'new/old':>8} {'whole old':>10} {'new':>7} {'new/old':>8}"
          " same tokens")
    for k, outs in tokens.items():
        cells = [f"{figures.median(('old', k, f)):10.1f} {figures.median(('new', k, f)):7.1f} "
                 f"{figures.ratio(('new', k, f), ('old', k, f)):8.2f}" for f in ("decode", "whole")]
        print(f"{k:10} {' '.join(cells)} {all(o == outs[0] for o in outs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
