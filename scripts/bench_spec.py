#!/usr/bin/env python
"""Speculative decoding on the default pair, side by side in one run.

For each prompt (code, summary, Chinese) and configuration (plain; draft model at fixed k and adaptive;
n-gram; lookup in front of the model, and the chain with the model first): decode tok/s (median of --runs after a warm-up), acceptance, tokens per round,
and whether the output equals plain greedy output. Greedy, --n tokens, bf16 target on this machine.

Usage: .venv/bin/python scripts/bench_spec.py [--runs 3] [-n 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import quickdraft
from quickdraft.tools.quality import TEXT as QUALITY_TEXT
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.weights import hub
from quickdraft.tools.runs import Figures, machine

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = "\n\n".join(QUALITY_TEXT.read_text(encoding="utf-8").split("\n\n")[:2])
PROMPTS = {
    "code": "Write a Python class for a least-recently-used cache with get and put methods, with comments.",
    "summary": "Summarize the following text in a few sentences, reusing its wording:\n\n" + ARTICLE,
    "chinese": "请用中文详细解释快速排序算法的原理，并分析它的时间复杂度。",
}
CTX = 1024


def configs(llm):
    adaptive = SpeculationConfig(draft_max=16)
    fixed = SpeculationConfig(draft_max=4, p_min=0.0, adaptive=False)
    draft, combined = hub.DEFAULT_DRAFT, f"ngram+{hub.DEFAULT_DRAFT}"  # the draft in int4 on the CPU
    return {
        "plain": llm.engine,
        "draft k=4": llm.engine_for(draft, fixed),
        "draft adaptive": llm.engine_for(draft, adaptive),
        "ngram adaptive": llm.engine_for("ngram", adaptive),
        "ngram+draft adaptive": llm.engine_for(combined, adaptive),
        "draft,ngram adaptive": llm.engine_for(f"{draft},ngram", adaptive),  # a chain: the model first
    }


def run_once(engine, prompt, n):
    events = list(engine.generate(prompt, SamplingParams(max_tokens=n, stop_at_eos=False)))
    return [e.token for e in events if e.token is not None], events[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    llm = quickdraft.load(hub.DEFAULT_TARGET, "none", device="cpu", dtype="bfloat16", context=CTX, progress=False)
    prompts = {k: llm.chat_prompt([{"role": "user", "content": v}]) for k, v in PROMPTS.items()}
    engines = configs(llm)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; target bf16, draft int4; "
          f"{args.n} greedy tokens, median of {args.runs} runs after a warm-up", file=sys.stderr)
    results, figures = [], Figures()  # decode tok/s by (prompt, configuration)
    for pname, prompt in prompts.items():
        reference = None
        for cname, engine in engines.items():
            run_once(engine, prompt, 16)  # warm-up (kernels, policy timings)
            last = None
            for _ in range(args.runs):
                tokens, last = run_once(engine, prompt, args.n)
                figures.add((pname, cname), last.timings.decode_tok_s)
            reference = tokens if cname == "plain" else reference
            s = last.stats
            results.append({
                "prompt": pname, "config": cname, "decode_tok_s": figures.median((pname, cname)),
                "runs": figures.samples[pname, cname], "same_as_plain": tokens == reference,
                "acceptance": s.acceptance_rate, "tokens_per_round": s.mean_accepted_length,
                "mean_k": sum(s.k_history) / max(len(s.k_history), 1), "policy": s.policy,
            })
            print(f"  {pname:8} {cname:22} {figures.median((pname, cname)):6.2f} tok/s", file=sys.stderr)
    print(f"\n{'prompt':8} {'config':22} {'tok/s':>7} {'x plain':>8} {'accept':>7} {'tok/round':>9} "
          f"{'mean k':>6}  same output")
    for r in results:
        x_plain = figures.ratio((r["prompt"], r["config"]), (r["prompt"], "plain"))
        print(f"{r['prompt']:8} {r['config']:22} {r['decode_tok_s']:7.2f} {x_plain:8.2f} "
              f"{100 * r['acceptance']:6.0f}% {r['tokens_per_round']:9.2f} {r['mean_k']:6.1f}  {r['same_as_plain']}")
    draft_policy = next(r["policy"] for r in results if r["config"] == "draft adaptive")
    t1 = draft_policy.get("t_plain_s") or 0
    print(f"\nmeasured: target step {1000 * t1:.0f} ms; r(draft) = "
          f"{draft_policy.get('r', {}).get('draft', float('nan')):.3f}; v(k) = "
          + ", ".join(f"{k}: {v:.2f}" for k, v in draft_policy.get("v", {}).items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
