#!/usr/bin/env python
"""The CUDA benchmark that scripts/gpu_check.sh runs, its table printed last:

1. plain decoding of the 1.5B target in bf16, int8 and int4 against the memory roofline (eager, replaying CUDA
   graphs with each token read back to the host as the engine does, and graphs without that sync), and v(k) for
   k = 1..16 in each format;
2. the default pair: r of the 0.5B draft in int4 against each target format, and the speed-up the speed model
   predicts at the acceptance the pair reaches on the CPU (--alpha: 0.75 per drafted token, what the pair accepts on
   the code prompt: docs/performance.md), k chosen as the policy would;
3. the 27B class (a 4-bit 27B model on a 24-32 GB card, what many run locally): a 27B-class target in int4 (roofline.STAND_INS, ~15 GiB) with the 0.5B-class draft in int4:
   plain tok/s against the roofline, v(k), r, the speed-up predicted at 4.8 tokens a round at k = 7, and the
   memory plan's figures for it on a 24 GiB card and on this one.

The models are the default pair when their GGUF files are in the cache, else random weights of their shapes (a GPU
machine has no network; a pass's speed depends on the shapes, not the values), made on the GPU one module at a
time through the loader's own build_model, so they are converted as a file's would be.

Every measurement that assumes CUDA graphs checks that they ran (a capture that fails turns them off with one
warning): a row whose graphs were off says why, and the script then exits 1. --json writes the table as JSON.
--quick runs every step on a tiny stand-in (dense-tiny) in place of each model: the CPU rehearsal of gpu_check.sh,
which tests the script, not speeds.

Usage: python scripts/gpu_bench.py [-n 256] [--runs 3] [--device cuda] [--skip-27b] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from quickdraft.tools import roofline
from quickdraft.tools.runs import Figures
from quickdraft.config import EngineConfig
from quickdraft.weights import memory
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.speed import expected_length, speedup
from quickdraft.weights import hub
from quickdraft.weights.loader import LoadedModel, load_model

TARGET, DRAFT, CLASS_27B = hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT, "dense-27b-class"


def load(name: str, fmt: str, device: torch.device, context: int, quick: bool) -> tuple[LoadedModel, str]:
    if quick:
        return roofline.stand_in("dense-tiny", device, fmt, context), f"dense-tiny for {name}"
    if name in hub.DEFAULT_MODELS and hub.is_pulled(name):
        config = EngineConfig(device=str(device), dtype="bfloat16", weights=fmt, max_context=context,
                              weight_cache=False)
        return load_model(name, config, False), "real weights"
    return roofline.stand_in(name, device, fmt, context), "random weights"


@torch.inference_mode()
def decode_tok_s(lm: LoadedModel, n: int, host_sync: bool, graphs: bool, prompt_len: int = 64) -> float:
    saved = lm.graphs
    lm.graphs = saved if graphs else None
    try:
        device = lm.device
        cache = KVCache.for_model(lm.model, prompt_len + n + 32)  # room for a graph's padded rows at every step
        prompt = torch.randint(0, min(1000, lm.config.vocab_size), (1, prompt_len), device=device)
        token = lm.forward(prompt, cache, last_only=True)[0, -1].argmax().reshape(1, 1)
        for _ in range(4):  # warm-up steps, then back to the prompt
            lm.forward(token, cache, last_only=True)
        cache.rollback(prompt_len)
        roofline.sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            token = lm.forward(token, cache, last_only=True)[0, -1].argmax().reshape(1, 1)
            if host_sync:
                token = torch.tensor([[int(token)]], device=device)
        roofline.sync(device)
        return n / (time.perf_counter() - t0)
    finally:
        lm.graphs = saved


def free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=256, help="tokens decoded per timing (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--alpha", type=float, default=0.75, help="acceptance per drafted token for the default pair's "
                                                              "prediction (default: %(default)s)")
    ap.add_argument("--skip-27b", action="store_true", help="leave out the 27B-class case")
    ap.add_argument("--quick", action="store_true", help="a tiny stand-in for every model (the CPU rehearsal)")
    ap.add_argument("--json", help="write the table here as JSON too")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: PyTorch sees no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = roofline.bandwidth(device)
    log = lambda text: print(f"gpu_bench: {text}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"{name}, torch {torch.__version__}, bandwidth {bw / 1e9:.0f} GB/s (copy/read, measured now)")
    rows, curves, steps, graphs_off = [], {}, {}, {}
    figures = Figures()  # decode tok/s by (label, mode)
    modes = {"eager": (True, False), "graphs": (True, True), "no sync": (False, True)}  # (host_sync, graphs)

    def measure(label, lm, source, with_eager=False, v_curve=True):
        per_pass = roofline.pass_bytes(lm.model, 64 + args.n // 2)
        for mode, (host_sync, graphs) in modes.items():
            if with_eager or mode != "eager":
                for _ in range(args.runs):
                    figures.add((label, mode), decode_tok_s(lm, args.n, host_sync, graphs))
        eager, sync, nosync = (figures.median((label, mode)) for mode in modes)  # (eager: None without)
        if v_curve:
            prompt = torch.randint(0, lm.config.vocab_size, (64,)).tolist()
            _, curves[label] = roofline.v_curve(lm, prompt, 16, reps=3)
        if lm.graphs is not None and lm.graphs.disabled:  # the figures above were eager passes, not graphs
            graphs_off[label] = lm.graphs.disabled
            log(f"CUDA graphs were OFF for {label}: {lm.graphs.disabled}")
        rows.append((f"{label} ({source})", per_pass / 1e6, eager, sync, nosync, bw / per_pass))
        steps[label] = 1 / sync
        log(f"{label}: {sync:.1f} tok/s with graphs, {', '.join(sorted(lm.plan.get('linear', {})))}; "
            f"attention {lm.plan.get('attention', 'PyTorch CPU')}; loaded in {lm.load_seconds:.1f} s")

    for fmt in ("bf16", "int8", "int4"):
        lm, source = load(TARGET, fmt, device, 1024, args.quick)
        measure(f"1.5B {fmt}", lm, source, with_eager=fmt == "bf16")
        del lm
        free(device)
    draft, source = load(DRAFT, "int4", device, 1024, args.quick)
    measure("0.5B int4 (draft)", draft, source, v_curve=False)
    del draft
    free(device)

    big = None
    if not args.skip_27b:
        torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
        lm, source = load(CLASS_27B, "int4", device, 1024, args.quick)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
        measure("27B-class int4", lm, source)
        big = (lm.load_seconds, peak, sum(t.numel() * t.element_size() for t in lm.model.buffers()) / 2**30)
        del lm
        free(device)

    print(f"\n{'plain decode, tok/s':40} {'MB/pass':>8} {'eager':>7} {'graphs':>7} {'no sync':>8} {'limit':>7} "
          f"{'% graphs':>8} {'% no sync':>9}")
    for label, mb, eager, sync, nosync, limit in rows:
        e = f"{eager:7.1f}" if eager else f"{'-':>7}"
        print(f"{label:40} {mb:8.0f} {e} {sync:7.1f} {nosync:8.1f} {limit:7.0f} {100 * sync / limit:7.0f}% "
              f"{100 * nosync / limit:8.0f}%")
    width = 1 + max((max(v) for v in curves.values()), default=0)
    print(f"\nv(k), passes of {width} rows (k = 1..{width - 1}):")
    for label, v in curves.items():
        print(f"  {label:16} " + " ".join(f"{v[k]:.2f}" for k in sorted(v)))
    draft_step = steps["0.5B int4 (draft)"]
    print(f"\ndefault pair (0.5B int4 draft), predicted at alpha = {args.alpha} per drafted token:")
    predicted = {}
    for fmt in ("bf16", "int8", "int4"):
        label = f"1.5B {fmt}"
        r = draft_step / steps[label]
        v = curves[label]
        best = max(v, key=lambda k: speedup(expected_length([args.alpha] * k), v[k], k, r))
        length = expected_length([args.alpha] * best)
        s = speedup(length, v[best], best, r)
        predicted[fmt] = {"r": r, "k": best, "expected_length": length, "v_k": v[best], "speedup": s,
                          "tok_s": s / steps[label]}
        print(f"  target {fmt:5}  r = {r:.2f}  best k = {best:2}  E[L] = {length:.2f}  v(k) = {v[best]:.2f}  "
              f"speed-up {s:.2f}x -> {s / steps[label]:.0f} tok/s")
    if big is not None:
        v, r = curves["27B-class int4"], draft_step / steps["27B-class int4"]
        plain = 1 / steps["27B-class int4"]
        s = speedup(4.8, v[7], 7, r)
        predicted["27B-class int4"] = {"r": r, "k": 7, "expected_length": 4.8, "v_k": v[7], "speedup": s,
                                       "tok_s": s * plain}
        print("\nthe 27B class: a 27B-class int4 target + 0.5B int4 draft (random weights of the shapes)")
        print(f"  plain {plain:.1f} tok/s ({100 * plain / rows[-1][5]:.0f}% of the roofline), r = {r:.3f}, "
              f"v(7) = {v[7]:.2f}; at 4.8 tokens a round, k = 7: predicted {s:.2f}x -> {s * plain:.0f} tok/s")
        print(f"  load: {big[0]:.1f} s module by module on the GPU, peak {big[1]:.2f} GiB allocated for "
              f"{big[2]:.2f} GiB of weights")
        cfg, dcfg = roofline.STAND_INS[CLASS_27B], roofline.STAND_INS[DRAFT]
        specs = [memory.ModelSpec("target", "27B-class Q4_K_M", cfg, "mixed", roofline.q4_k_m_types(cfg)),
                 memory.ModelSpec("draft", "0.5B-class", dcfg, "int4")]
        for capacity in (24 * 2**30, None):
            p = memory.plan(specs, 8192, device, capacity)
            print(f"  memory plan, 8k context, {p.capacity / 2**30:.0f} GiB:\n" + "\n".join(p.lines()))
    if args.json:
        table = [dict(zip(("model", "mb_per_pass", "eager_tok_s", "graphs_tok_s", "no_sync_tok_s", "roofline_tok_s"),
                          row)) for row in rows]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": name, "torch": torch.__version__, "bandwidth_gb_s": bw / 1e9, "decode": table,
                       "v": curves, "predicted": predicted, "graphs_off": graphs_off,
                       "load_27b": None if big is None else dict(zip(("load_s", "peak_gib", "weights_gib"), big))},
                      f, indent=1)
    if graphs_off:
        print(f"\ngpu_bench: CUDA graphs were off for {', '.join(graphs_off)}: those figures are eager passes")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
