#!/usr/bin/env python
"""How far back a draft model must look: acceptance and cost against --draft-window on long prompts.

For each prompt (the bundled long ones: ~1k, ~5.5k and ~11.5k tokens), the target's greedy answer of -n tokens is made
once; then for each window W a draft model drafting from W tokens (0: the whole context) replays the rounds the engine
would run over that answer at a fixed k (the target's choice at each position is known: exact for greedy decoding), each
round's drafts against the answer. Printed per prompt and window: the draft's catch-up after the prompt's prefill (the
seconds it takes in the prompt, or its window), acceptance, tokens a round, seconds per drafted token, and the speed-up
over plain decoding these predict for the answer (catch-up included), from the target's own plain step and
verification pass timed at that context in this run.

Usage: python scripts/bench_window.py [--windows 64,128,256,512,1024,0] [--prompts long-1k,review-5k,review-12k]
       [-n 128] [-k 4]
"""

from __future__ import annotations

import argparse
import time

import torch

import quickdraft
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.timing import median_seconds
from quickdraft.speculative.draft import Draft
from quickdraft.tools import prompts as bundled
from quickdraft.tools.runs import machine


def replay(drafter, prompt: list[int], answer: list[int], k: int) -> dict:
    """The rounds of a fixed-k greedy run over a known answer: the drafter proposes, the answer decides."""
    t0 = time.perf_counter()
    drafter.begin(prompt)
    catch_up = time.perf_counter() - t0
    t, rounds, drafted, kept, draft_s = 1, 0, 0, 0, 0.0  # answer[0] is the prefill's token
    params = SamplingParams(max_tokens=len(answer))
    while t < len(answer):
        t0 = time.perf_counter()
        proposal = drafter.propose(prompt + answer[:t], lambda source: min(k, len(answer) - t - 1), params, None)
        draft_s += time.perf_counter() - t0
        n = 0
        while n < len(proposal.tokens) and t + n < len(answer) and proposal.tokens[n] == answer[t + n]:
            n += 1
        rounds, drafted, kept, t = rounds + 1, drafted + len(proposal.tokens), kept + n, t + n + 1
    return {"catch_up_s": catch_up, "rounds": rounds, "drafted": drafted, "kept": kept, "draft_s": draft_s}


@torch.inference_mode()
def target_costs(llm, prompt: list[int], k: int) -> tuple[float, float]:
    """The target's plain step and its verification of k drafts at this context (seconds, medians)."""
    target = llm.target
    cache = KVCache.for_model(target.model, len(prompt) + k + 2)
    target.prefill(torch.tensor([prompt]), cache)
    n = cache.length
    plain = median_seconds(lambda: target.forward(torch.tensor([prompt[-1:]]), cache), target.device, 5,
                           lambda: cache.rollback(n))
    verify = median_seconds(lambda: target.forward(torch.tensor([prompt[-1:] * (k + 1)]), cache), target.device, 5,
                            lambda: cache.rollback(n))
    return plain, verify


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="64,128,256,512,1024,0")
    ap.add_argument("--prompts", default="long-1k,review-5k,review-12k")
    ap.add_argument("-n", type=int, default=128, help="greedy tokens of each answer")
    ap.add_argument("-k", type=int, default=4, help="tokens drafted a round")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    windows = [int(w) for w in args.windows.split(",")]
    llm = quickdraft.load("qwen2.5-coder-1.5b", "none", context=16384, progress=False)
    draft = Draft.parse("qwen2.5-coder-0.5b")
    print(f"the default pair, k = {args.k}, {args.n} greedy tokens a prompt; x: the speed-up over plain decoding "
          "predicted for the answer")
    print(f"{'prompt':11} {'tokens':>6} {'window':>6} {'catch-up s':>10} {'accepted':>8} {'tok/round':>9} "
          f"{'ms/draft':>8} {'x':>5}")
    for name in args.prompts.split(","):
        prompt = bundled.encoded(llm.tokenizer, [name])[name]
        answer = llm.generate(prompt, max_tokens=args.n, temperature=0, stop_at_eos=False).tokens
        t_plain, t_verify = target_costs(llm, prompt, args.k)
        for w in windows:
            drafter = llm.drafter(draft, SpeculationConfig(draft_window=w))
            r = replay(drafter, prompt, answer, args.k)
            whole = r["catch_up_s"] + r["rounds"] * t_verify + r["draft_s"]
            x = (len(answer) - 1) * t_plain / whole
            print(f"{name:11} {len(prompt):6} {w or 'all':>6} {r['catch_up_s']:10.2f} "
                  f"{r['kept'] / max(r['drafted'], 1):8.0%} {(len(answer) - 1) / r['rounds']:9.2f} "
                  f"{1000 * r['draft_s'] / max(r['drafted'], 1):8.1f} {x:5.2f}", flush=True)
            del drafter
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
