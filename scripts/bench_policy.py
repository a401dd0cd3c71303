#!/usr/bin/env python
"""The adaptive policy of a git revision against the working tree's, side by side in one run.

One loaded target and draft; three engines over them (plain, the pair under REV's policy, the pair under this
tree's), each prompt's runs taken in turn so that the machine's drift falls on all three alike. Prints decode
tok/s medians, the ratio to plain, acceptance and whether the output equals plain, per prompt. A policy change is
judged over several such runs: on the shared 2-core machine one run of one prompt moves by 10-25%.

REV's policy.py is loaded from git as it was (it must take the same SpeculationConfig); a catch-up argument it does
not know is dropped.

Usage: .venv/bin/python scripts/bench_policy.py [--rev HEAD] [--weights int4] [--prompts code-en,summary-en]
       [--runs 3] [-n 256] [--draft ngram+qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import types
from pathlib import Path

import quickdraft
from quickdraft.tools import prompts as bundled
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.speculative.draft import Draft
from quickdraft.tools.runs import Figures, machine, rotated

ROOT = Path(__file__).resolve().parents[1]


def policy_at(rev: str):
    """The AdaptivePolicy class of quickdraft/speculative/policy.py at git revision rev."""
    source = subprocess.run(["git", "show", f"{rev}:quickdraft/speculative/policy.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("policy_at_rev")
    exec(compile(source, f"{rev}:quickdraft/speculative/policy.py", "exec"), module.__dict__)
    base = module.AdaptivePolicy
    if "catch_up_s" in inspect.signature(base.record_round).parameters:
        return base

    class Policy(base):
        def record_round(self, source, drafted, accepted, draft_s, verify_s, catch_up_s=0.0):
            super().record_round(source, drafted, accepted, draft_s, verify_s)

    return Policy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision whose policy is compared (default HEAD)")
    ap.add_argument("--weights", default="int4", help="the target's format (default int4)")
    ap.add_argument("--draft", default="ngram+qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", default=",".join(bundled.PROMPTS), help="bundled prompt names, comma-separated")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=256, help="greedy tokens per run (end of text ignored)")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    names = args.prompts.split(",")
    unknown = [n for n in names if n not in bundled.PROMPTS]
    if unknown:
        sys.exit(f"unknown prompt {unknown[0]!r}: use some of {', '.join(bundled.PROMPTS)}")

    llm = quickdraft.load(weights=args.weights, draft=args.draft, progress=False)
    cfg = SpeculationConfig(adaptive=True)
    draft = Draft.parse(args.draft)
    engines = {"plain": llm.engine_for(Draft.parse("none"), SpeculationConfig(draft_max=0, draft_min=0)),
               args.rev: llm.engine_for(draft, cfg), "tree": llm.engine_for(draft, cfg)}
    engines[args.rev].policy = policy_at(args.rev)(cfg)
    params = SamplingParams(max_tokens=args.n, stop_at_eos=False)
    compared = [k for k in engines if k != "plain"]  # REV's policy and this tree's
    figures, ratios = Figures(), Figures()  # by (prompt, engine[, "accepted"]); each prompt's ratio to plain by engine
    print(f"{args.weights} target, {args.draft}; decode tok/s, median of {args.runs} runs taken in turn; "
          f"x = against plain; % = drafts accepted")
    for name in names:
        prompt = bundled.encoded(llm.tokenizer, [name])[name]
        for engine in engines.values():  # warm-up
            list(engine.generate(prompt, SamplingParams(max_tokens=16, stop_at_eos=False)))
        tokens = {}
        for r in range(args.runs):
            for k in rotated(list(engines), r):
                events = list(engines[k].generate(prompt, params))
                figures.add((name, k), events[-1].timings.decode_tok_s)
                figures.add((name, k, "accepted"), events[-1].stats.acceptance_rate)
                tokens[k] = [e.token for e in events if e.token is not None]
        line = f"{name:11} plain {figures.median((name, 'plain')):6.2f}"
        for k in compared:
            ratio = figures.ratio((name, k), (name, "plain"))
            ratios.add(k, ratio)
            line += (f" | {k} {figures.median((name, k)):6.2f} ({ratio:.2f}x) "
                     f"{100 * figures.median((name, k, 'accepted')):3.0f}%"
                     f"{'' if tokens[k] == tokens['plain'] else ' DIFFERS FROM PLAIN'}")
        print(line, flush=True)
    for k in compared:
        low, high = ratios.spread(k)
        print(f"{k}: x plain {low:.2f}-{high:.2f}, median {ratios.median(k):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
