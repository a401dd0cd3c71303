#!/usr/bin/env python
"""Decode speed of two checkouts, A/B: OLD and NEW take turns (a fresh process each sample, the order swapped every
round), the default target plain and with its default draft, 128 greedy tokens on a code and a Chinese prompt;
medians and ratios, and whether both gave the same tokens. "decode" is the engine's own figure (tokens after the
first over the time from the first); "whole" is tokens over the wall time of the call, what a user waits for.

Usage: .venv/bin/python scripts/bench_ab.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 3]
       (an old revision as a worktree: git worktree add /tmp/old REV)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    from quickdraft.tools.runs import machine  # (not at the top: a sample runs an old checkout, which may lack it)

    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    samples: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        order = [("old", args.old), ("new", args.new)]
        for name, path in order if r % 2 == 0 else order[::-1]:
            path = os.path.abspath(path)
            child = subprocess.run([sys.executable, os.path.abspath(__file__), path, path, "--sample"],
                                   capture_output=True, text=True, cwd=path, env={**os.environ, "PYTHONPATH": path})
            if child.returncode:
                print(child.stderr[-3000:], file=sys.stderr)
                return 1
            samples[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: " + ", ".join(f"{k} {v[0]:.1f}" for k, v in samples[name][-1].items()),
                  file=sys.stderr, flush=True)
    print(f"{'case':10} {'decode old':>10} {'new':>7} {'new/old':>8} {'whole old':>10} {'new':>7} {'new/old':>8}"
          " same tokens")
    for k in samples["old"][0]:
        def med(name, i):
            return statistics.median(s[k][i] for s in samples[name])
        same = all(s[k][1] == samples["old"][0][k][1] for s in samples["old"] + samples["new"])
        print(f"{k:10} {med('old', 0):10.1f} {med('new', 0):7.1f} {med('new', 0) / med('old', 0):8.2f} "
              f"{med('old', 2):10.1f} {med('new', 2):7.1f} {med('new', 2) / med('old', 2):8.2f} {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
