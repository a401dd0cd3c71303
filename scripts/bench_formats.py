#!/usr/bin/env python
"""The runtime weight formats side by side on this machine, in one run: for the target in bf16, int8, int4 and mixed,
plain decode tok/s, bytes read per token, the share of the memory bandwidth measured in the same run,
v(k) for k = 1..16, perplexity on the same text, and peak memory; then the pair loaded for speculation
(target and draft both int4) against the size of the two GGUF files. Every load converts (no conversion
kept on disk is read back): the peaks are those of a first load.

Each format is measured in its own process (so that its peak memory is its own); the formats take turns
--runs times (the order rotated each run) and medians are reported.

Usage: .venv/bin/python scripts/bench_formats.py [--formats bf16,int8,int4,mixed] [-n 64] [--runs 3] [--ppl-chunks 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from quickdraft.tools.runs import Figures, machine, rotated

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(fmt: str, n: int, ppl_chunks: int) -> dict:
    """In this process: load the target in fmt, decode, time v(k), score perplexity."""
    import torch

    import quickdraft
    from quickdraft.tools import roofline
    from quickdraft.cli import DEMO_PROMPT
    from quickdraft.config import SamplingParams
    from quickdraft.perplexity import perplexity
    from quickdraft.tools.quality import TEXT as QUALITY_TEXT
    from quickdraft.weights import hub

    llm = quickdraft.load(hub.DEFAULT_TARGET, "none", device="cpu", dtype="bfloat16", weights=fmt, context=1024,
                          weight_cache=False, progress=False)
    lm = llm.target
    load_peak = peak_rss_gib()
    prompt = llm.chat_prompt([{"role": "user", "content": DEMO_PROMPT}])
    list(llm.stream(prompt, params=SamplingParams(max_tokens=8, stop_at_eos=False)))  # warm-up
    final = list(llm.stream(prompt, params=SamplingParams(max_tokens=n, stop_at_eos=False)))[-1]
    t1, v = roofline.v_curve(lm, prompt, 16)
    text = QUALITY_TEXT.read_text(encoding="utf-8")
    tokens = lm.tokenizer.encode(text, add_bos=False)
    ppl = perplexity(lm.model, tokens, 256, None, ppl_chunks).ppl if ppl_chunks else None
    return {"format": fmt, "decode_tok_s": final.timings.decode_tok_s, "pass_bytes": roofline.pass_bytes(lm.model, len(prompt) + n // 2),
            "t_pass_s": t1, "v": v, "ppl": ppl, "load_peak_gib": load_peak, "threads": torch.get_num_threads()}


def pair_peak() -> dict:
    from quickdraft.config import EngineConfig
    from quickdraft.runtime.kv_cache import KVCache
    from quickdraft.weights import hub
    from quickdraft.weights.loader import load_model

    # converting, not reading back a kept conversion (weights/converted.py): the larger peak of the two
    cfg = EngineConfig(device="cpu", dtype="bfloat16", weights="int4", max_context=4096, weight_cache=False)
    target = load_model(hub.DEFAULT_TARGET, cfg, progress=False)
    draft = load_model(hub.DEFAULT_DRAFT, cfg, progress=False)
    caches = [KVCache.for_model(lm.model, cfg.max_context) for lm in (target, draft)]  # what speculation holds
    for c in caches:
        c.k.fill_(1), c.v.fill_(1)  # touched, as a full context would
    files = sum(hub.DEFAULT_MODELS[a].size for a in (hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT)) / 2**30
    del target, draft, caches
    return {"pair_peak_gib": peak_rss_gib(), "gguf_gib": files}


def child(args) -> int:
    out = pair_peak() if args.child == "pair" else measure(args.child, args.n, args.ppl_chunks)
    print(json.dumps(out))
    return 0


def run_child(what: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", what, "-n", str(args.n), "--ppl-chunks", str(args.ppl_chunks)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{what}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,int8,int4,mixed")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ppl-chunks", type=int, default=4, help="256-token windows scored (0: skip perplexity)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    if args.child:
        return child(args)
    import torch

    from quickdraft.tools import roofline

    formats = args.formats.split(",")
    results = {f: [] for f in formats}
    figures = Figures()  # "bandwidth", (format, "decode") and (format, "v", k) over the runs
    for i in range(args.runs):
        figures.add("bandwidth", roofline.bandwidth(torch.device("cpu")))
        for f in rotated(formats, i):
            print(f"run {i + 1}/{args.runs}: {f}", file=sys.stderr)
            r = run_child(f, argparse.Namespace(**{**vars(args), "ppl_chunks": args.ppl_chunks if i == 0 else 0}))
            results[f].append(r)
            figures.add((f, "decode"), r["decode_tok_s"])
            for k, v in r["v"].items():
                figures.add((f, "v", k), v)
    pair = run_child("pair", args)
    bw = figures.median("bandwidth")
    rows = []
    for f in formats:
        rs = results[f]
        tok_s, (low, high) = figures.median((f, "decode")), figures.spread((f, "decode"))
        v = {k: figures.median((f, "v", k)) for k in rs[0]["v"]}
        pass_bytes = rs[0]["pass_bytes"]
        rows.append({"format": f, "decode_tok_s": tok_s, "decode_min": low, "decode_max": high,
                     "pass_bytes": pass_bytes, "limit_tok_s": bw / pass_bytes,
                     "bandwidth_share": tok_s * pass_bytes / bw, "v": v,
                     "ppl": rs[0]["ppl"], "load_peak_gib": max(r["load_peak_gib"] for r in rs)})
    base = next((r["ppl"] for r in rows if r["format"] == "bf16"), None)
    print(f"\nthe 1.5B target, plain greedy decoding, {args.n} tokens, medians of {args.runs} runs; memory bandwidth "
          f"{bw / 1e9:.1f} GB/s (median of {args.runs} measurements in this run)")
    print(f"{'format':7} {'tok/s':>6} {'(min-max)':>11} {'MB/tok':>7} {'limit':>6} {'of bw':>6} {'v(1)':>5} {'v(4)':>5} "
          f"{'v(7)':>5} {'v(16)':>6} {'ppl':>7} {'vs bf16':>8} {'peak GiB':>8}")
    for r in rows:
        ppl = f"{r['ppl']:7.3f}" if r["ppl"] else "      -"
        rel = f"{100 * (r['ppl'] / base - 1):+7.1f}%" if r["ppl"] and base else "       -"
        print(f"{r['format']:7} {r['decode_tok_s']:6.2f} {r['decode_min']:5.2f}-{r['decode_max']:5.2f} "
              f"{r['pass_bytes'] / 1e6:7.0f} {r['limit_tok_s']:6.1f} {100 * r['bandwidth_share']:5.0f}% "
              f"{r['v']['1']:5.2f} {r['v']['4']:5.2f} {r['v']['7']:5.2f} {r['v']['16']:6.2f} {ppl} {rel} "
              f"{r['load_peak_gib']:8.2f}")
    print(f"pair loaded for speculation (both int4, KV caches for 4096 tokens): peak {pair['pair_peak_gib']:.2f} GiB, "
          f"{pair['pair_peak_gib'] / pair['gguf_gib']:.2f}x the two GGUF files ({pair['gguf_gib']:.2f} GiB)")
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gb_s": bw / 1e9, "rows": rows, "pair": pair}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
