#!/usr/bin/env python
"""How far each runtime weight format moves the 1.5B target's next-token distributions from bf16's, on the same
text: mean KL(bf16 || format) per position, the share of positions whose top-1 token agrees, and perplexity: what
`tune --formats` weighs (quickdraft/tools/quality.py computes it; this prints it for the default target alone).

Perplexity over the bundled ~1,000 tokens moves by ~2% when codes change by one step here and there (loading the
same int8 weights from float32 instead of bf16 values, a slightly *smaller* weight error, moved it from 16.83 to
17.19): too coarse to rank formats a few tenths of a percent apart. The KL divergence to the bf16 model's
distributions at every position is steadier.

Usage: .venv/bin/python scripts/bench_quality.py [--formats int8,int4,mixed]
"""

from __future__ import annotations

import argparse
import gc

from quickdraft.config import EngineConfig
from quickdraft.tools import quality
from quickdraft.weights import hub
from quickdraft.weights.loader import load_model
from quickdraft.tools.runs import machine


def load(fmt: str):
    return load_model(hub.DEFAULT_TARGET, EngineConfig(device="cpu", dtype="bfloat16", weights=fmt,
                                                       max_context=quality.WINDOW), progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int8,int4,mixed")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    lm = load("bf16")
    tokens = quality.text_tokens(lm.tokenizer)
    reference = quality.log_probs(lm.model, tokens)
    del lm
    gc.collect()
    print(f"the 1.5B target on {len(tokens)} tokens of {quality.TEXT.name} ({quality.WINDOW}-token windows), "
          "against bf16")
    print(f"{'format':7} {'KL mean':>8} {'top-1 agrees':>13} {'perplexity':>11}")
    for fmt in args.formats.split(","):
        lm = load(fmt)
        q = quality.compare(lm.model, tokens, reference)
        print(f"{fmt:7} {q.kl:8.4f} {q.top1:12.1%} {q.ppl:8.2f} ({q.ppl_increase:+.1f}%)")
        del lm
        gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
