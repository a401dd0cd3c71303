#!/usr/bin/env python
"""Tree verification against chains on the default pair (the 0.5B draft), side by side in one run.

For each prompt (code, summary, Chinese) and configuration: plain; the draft's chain at fixed k = 4; the same chain
with up to 1 or 2 alternatives at its least sure position (--draft-tree 2, 3), verified in the same pass; and, adaptive,
the chain alone against the policy choosing chain or tree (--draft-tree 3) round by round. Prints decode tok/s (median
of --runs after a warm-up), tokens per round, the share of rounds that verified a tree and how often one kept an
alternative, the tree pass's cost against a chain pass's of as many rows, and whether the output equals plain greedy
output. Greedy, -n tokens, bf16 target, int4 draft.

    .venv/bin/python scripts/bench_tree.py [--runs 3] [-n 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import quickdraft  # noqa: E402
from quickdraft.config import SamplingParams, SpeculationConfig  # noqa: E402
from quickdraft.weights import hub  # noqa: E402
from quickdraft.tools.runs import Figures, machine  # noqa: E402
from scripts.bench_spec import CTX, PROMPTS  # noqa: E402


def configs(llm):
    draft = hub.DEFAULT_DRAFT
    fixed = dict(draft_max=4, p_min=0.0, adaptive=False)
    return {
        "plain": llm.engine,
        "chain k=4": llm.engine_for(draft, SpeculationConfig(**fixed)),
        "tree k=4 B=2": llm.engine_for(draft, SpeculationConfig(**fixed, tree=2)),
        "tree k=4 B=3": llm.engine_for(draft, SpeculationConfig(**fixed, tree=3)),
        "chain adaptive": llm.engine_for(draft, SpeculationConfig()),
        "tree adaptive B=3": llm.engine_for(draft, SpeculationConfig(tree=3)),
    }


def run_once(engine, prompt, n):
    events = list(engine.generate(prompt, SamplingParams(max_tokens=n, stop_at_eos=False)))
    return [e.token for e in events if e.token is not None], events[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    llm = quickdraft.load(hub.DEFAULT_TARGET, "none", device="cpu", dtype="bfloat16", context=CTX, progress=False)
    prompts = {k: llm.chat_prompt([{"role": "user", "content": v}]) for k, v in PROMPTS.items()}
    engines = configs(llm)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; target bf16, draft int4; {args.n} greedy "
          f"tokens, median of {args.runs} runs after a warm-up", file=sys.stderr)
    rows, figures = [], Figures()  # decode tok/s by (prompt, configuration)
    for pname, prompt in prompts.items():
        reference = None
        for cname, engine in engines.items():
            run_once(engine, prompt, 16)  # warm-up (kernels, the policy's timings)
            for _ in range(args.runs):
                tokens, last = run_once(engine, prompt, args.n)
                figures.add((pname, cname), last.timings.decode_tok_s)
            reference = tokens if cname == "plain" else reference
            s = last.stats
            rows.append({"prompt": pname, "config": cname, "tok_s": figures.median((pname, cname)),
                         "per_round": s.mean_accepted_length, "rounds": s.rounds, "trees": s.tree_rounds,
                         "kept": s.tree_alternatives_kept, "same": tokens == reference, "policy": s.policy})
            print(f"  {pname:8} {cname:18} {figures.median((pname, cname)):6.2f} tok/s", file=sys.stderr)
    print(f"\n{'prompt':8} {'config':18} {'tok/s':>7} {'x plain':>8} {'x chain':>8} {'tok/round':>9} "
          f"{'tree rounds':>11} {'alt kept':>8}  same output")
    for r in rows:
        key, chain = (r["prompt"], r["config"]), "chain adaptive" if "adaptive" in r["config"] else "chain k=4"
        x_plain, x_chain = figures.ratio(key, (r["prompt"], "plain")), figures.ratio(key, (r["prompt"], chain))
        trees = f"{r['trees']}/{r['rounds']}" if r["rounds"] else "-"
        kept = f"{r['kept'] / r['trees']:.2f}" if r["trees"] else "-"
        print(f"{r['prompt']:8} {r['config']:18} {r['tok_s']:7.2f} {x_plain:8.2f} "
              f"{x_chain:8.2f} {r['per_round']:9.2f} {trees:>11} {kept:>8}  {r['same']}")
    policy = next(r["policy"] for r in reversed(rows) if r["config"] == "tree k=4 B=3")
    if policy.get("v_tree"):
        print("\nmeasured pass cost over a plain step, by drafted rows: chain v = "
              + ", ".join(f"{k}: {v:.2f}" for k, v in policy.get("v", {}).items())
              + "; tree v = " + ", ".join(f"{k}: {v:.2f}" for k, v in policy["v_tree"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
