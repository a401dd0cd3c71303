#!/usr/bin/env python
"""What exact rollback over a hybrid model's recurrent state costs, and a hybrid's decode speed plain and speculative.

On a random-weight model of about Qwen3.5-0.8B's dimensions (roofline.STAND_INS["hybrid-0.8b-class"]: 18 Gated DeltaNet
layers, 6 gated attention layers) in --weights (default int4) on this machine:

1. a verification pass of 8 tokens with state recovery (the states after each position kept: runtime/kv_cache.py's
   RecurrentState) against the same pass without (only its last state: no rollback into it), alternating, medians;
   and what the other design, recomputing from the last committed state, would cost per rollback (the recurrence
   of the kept tokens again), with the memory each needs;
2. decode tok/s of a tiny hybrid (STAND_INS["hybrid-tiny"], peaked random logits) plain and with speculation: a draft
   model (the same weights plus noise: agreeing often, not always) and n-gram lookup (a prompt that holds its own
   continuation), greedy, the outputs compared token for token.

Usage: python scripts/bench_hybrid.py [--weights int4] [--reps 15] [-n 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from quickdraft.quant import vnni
from quickdraft.tools import roofline
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime.kv_cache import HISTORY, KVCache, RecurrentState
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.tools.runs import Figures, machine, rotated


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("-n", type=int, default=64, help="tokens decoded per generation (default: %(default)s)")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    lm = roofline.stand_in("hybrid-0.8b-class", "cpu", args.weights, 1024)
    model = lm.model
    linear = [b.attention for b in model.layers if b.attention.kind == "linear"]
    print(f"bench_hybrid: {len(linear)} linear + {len(model.layers) - len(linear)} attention layers, {args.weights}, "
          f"built in {lm.load_seconds:.0f} s; kernels: {lm.plan.get('linear')}; fused recurrence: "
          f"{all(a.fused_step for a in linear)}")
    cache = KVCache.for_model(model, 1024)
    prompt = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    model(prompt, cache)
    feed = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))

    def verify(keep: bool) -> float:
        RecurrentState.keep_history = keep
        try:
            seconds = timed(lambda: model(feed, cache))
        finally:
            RecurrentState.keep_history = True
        cache.rollback(128)
        return seconds

    for keep in (True, False):  # warm-up
        verify(keep)
    figures = Figures()  # seconds by ("verify", keep), "recurrence"; decode tok/s by (label, "plain" or "spec")
    for r in range(args.reps):
        for keep in rotated([True, False], r):
            figures.add(("verify", keep), verify(keep))
    w, wo = figures.median(("verify", True)), figures.median(("verify", False))
    state = cache.recurrent[0]
    per_layer = state.ssm.numel() * 4 + state.conv.numel() * state.conv.element_size()
    slots = state.slots.shape[0]

    # recomputing instead: the recurrence of up to 8 tokens again, per linear layer, from a committed state
    a = linear[0]
    q = torch.randn(1, a.v_heads, a.k_dim)
    k = torch.nn.functional.normalize(torch.randn(1, a.v_heads, a.k_dim), dim=-1)
    v, d, b = torch.randn(1, a.v_heads, a.v_dim), torch.rand(1, a.v_heads), torch.rand(1, a.v_heads)
    ssm, spare = state.ssm.clone(), state.ssm.clone()

    def recurrence() -> None:
        s, t = ssm, spare
        for _ in range(8):
            if a.fused_step:
                vnni.ops().gated_delta_step(s, q, k, v, d, b, t)
                s, t = t, s
            else:
                s = s * d[..., None, None] + k[..., None] * v[..., None, :]

    for _ in range(args.reps):
        figures.add("recurrence", timed(recurrence))
    recompute = figures.median("recurrence") * len(linear)
    print(f"\nverification pass of 8 tokens, median of {args.reps} (alternating):")
    print(f"  with state recovery (the states after each position kept)   {1e3 * w:7.1f} ms")
    print(f"  without (only the last state: no rollback into the pass)    {1e3 * wo:7.1f} ms   "
          f"ratio {figures.ratio(('verify', True), ('verify', False)):.3f}")
    print(f"  kept states: {slots} slots ({HISTORY} positions back) x {per_layer / 2**20:.2f} MiB x {len(linear)} "
          f"layers = {slots * per_layer * len(linear) / 2**20:.0f} MiB; recomputing from the last committed state instead "
          f"would keep one state ({per_layer * len(linear) / 2**20:.0f} MiB) and cost up to "
          f"{1e3 * recompute:.1f} ms per rollback (the recurrence of 8 tokens again in every linear layer)")

    params = SamplingParams(max_tokens=args.n, stop_at_eos=False)
    seed = [5, 17, 250, 3, 99, 42, 7, 5, 17, 250, 3, 11, 64, 128, 5, 17]

    def run(engine, tokens):
        events = list(engine.generate(tokens, params))
        return [e.token for e in events if e.token is not None], events[-1]

    tiny = roofline.stand_in("hybrid-tiny", "cpu", "bf16", 1024, logit_scale=200)
    draft = roofline.stand_in("hybrid-tiny", "cpu", "bf16", 1024, noise=0.3, logit_scale=200)
    plain_engine = Engine(tiny, 1024)
    echo = seed + run(plain_engine, seed)[0] + seed
    engines = {"draft model, k = 4": (Engine(tiny, 1024, DraftModelDrafter(draft, 512, 1024),
                                             SpeculationConfig(draft_max=4, adaptive=False)), seed),
               "n-gram, adaptive": (Engine(tiny, 1024, NgramDrafter(), SpeculationConfig(draft_max=8)), echo)}
    print(f"\ndecode of the tiny hybrid, {args.n} greedy tokens, medians of 3 (alternating), outputs identical:")
    for label, (engine, prompt) in engines.items():
        for r in range(3):
            outputs = {}  # by "plain" and "spec": (tokens, the final event)
            for kind in rotated(["plain", "spec"], r):
                outputs[kind] = run(plain_engine if kind == "plain" else engine, prompt)
                figures.add((label, kind), outputs[kind][1].timings.decode_tok_s)
            assert outputs["spec"][0] == outputs["plain"][0], f"{label}: speculative output differs from plain output"
        p, s = figures.median((label, "plain")), figures.median((label, "spec"))
        x, stats = figures.ratio((label, "spec"), (label, "plain")), outputs["spec"][1].stats
        print(f"  plain {p:6.1f} tok/s   {label:20} {s:6.1f} tok/s   {x:.2f}x   ({stats.rounds} rounds, "
              f"{100 * stats.acceptance_rate:.0f}% of {stats.draft_n} drafts accepted, "
              f"{stats.mean_accepted_length:.2f} tokens a round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
