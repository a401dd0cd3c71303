#!/usr/bin/env python
"""The CUDA benchmark that scripts/gpu_check.sh runs, its table printed last and --json rewritten after every row (a
phase killed at its limit still leaves the rows it measured):

1. plain decoding of the 1.5B target in bf16, int8 and int4 against the memory roofline (eager, replaying CUDA
   graphs with each token read back to the host as the engine does, and graphs without that sync), and v(k) for
   k = 1..15 in each format;
2. the default pair: r of the 0.5B draft in int4 against each target format, and the speed-up the speed model
   predicts at the acceptance the pair reaches on the CPU (--alpha: 0.75 per drafted token, what the pair accepts on
   the code prompt: docs/performance.md), k chosen as the policy would;
3. the 27B class (a 4-bit 27B model on a 24-32 GB card, what many run locally), two rows that bracket it:
   - "27B dense stand-in": Qwen3.5-27B's sizes with all 64 layers as attention layers, in int4, graphed: a model
     quickdraft serves at graph speed, not Qwen3.5-27B itself;
   - "27B hybrid (Qwen3.5-27B)": its 48 Gated DeltaNet and 16 gated attention layers in int4, run as the engine
     serves a hybrid on CUDA (eagerly, each pass padded to 16 rows, each token read back): the figure a user of
     Qwen3.5-27B would see;
   with the 0.5B-class draft: r, v(k), and the speed-up predicted at 4.8 tokens a round (k = 7 where the model
   allows it);
4. the 24 GiB fit: the process held to 24 GiB of the device (the caching allocator refuses beyond), the 27B dense
   stand-in shaped as a Q4_K_M file (llama.cpp's recipe: Q6_K tensors in int8, Q4_K in int4; its token table in
   int8) with the 0.5B-class draft in int4 and 8k-position caches: a prefill to near the end of the context and a
   few rounds of 7 drafts, and the memory plan's figures beside the allocator's peak.

The models are the default pair when their GGUF files are in the cache, else random weights of their shapes (a GPU
machine has no network; a pass's speed depends on the shapes, not the values), made on the GPU one module at a
time through the loader's own build_model, so they are converted as a file's would be.

Every measurement that assumes CUDA graphs checks that they ran (a capture that fails turns them off with one
warning): a row whose graphs were off says why, and the script then exits 1. --quick runs every step on a tiny
stand-in (dense-tiny, hybrid-tiny) in place of each model: the CPU rehearsal of gpu_check.sh, which tests the
script, not speeds.

Usage: python scripts/gpu_bench.py [-n 256] [--runs 3] [--device cuda] [--skip-27b] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from quickdraft.config import EngineConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.speed import expected_length, speedup
from quickdraft.tools import roofline
from quickdraft.tools.runs import Figures
from quickdraft.weights import hub, memory
from quickdraft.weights.loader import LoadedModel, load_model

TARGET, DRAFT = hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT
DENSE_27B, HYBRID_27B = "dense-27b-class", "hybrid-27b-class"
FIT_GIB, FIT_CONTEXT, FIT_ROUNDS, FIT_K = 24, 8192, 4, 7
MODES = {"eager": (True, False), "graphs": (True, True), "no sync": (False, True)}  # (host_sync, graphs)


def load(name: str, fmt: str, device: torch.device, context: int, quick: bool, **kw) -> tuple[LoadedModel, str]:
    if quick:
        tiny = "hybrid-tiny" if "linear" in (roofline.STAND_INS[name].layer_types or ()) else "dense-tiny"
        return roofline.stand_in(tiny, device, fmt, context, **kw), f"{tiny} for {name}"
    if name in hub.DEFAULT_MODELS and hub.is_pulled(name):
        config = EngineConfig(device=str(device), dtype="bfloat16", weights=fmt, max_context=context,
                              weight_cache=False)
        return load_model(name, config, False), "real weights"
    return roofline.stand_in(name, device, fmt, context, **kw), "random weights"


@torch.inference_mode()
def decode_tok_s(lm: LoadedModel, n: int, host_sync: bool, graphs: bool, prompt_len: int = 64) -> float:
    """Plain decoding speed: a prompt, 4 warm-up steps, then n timed steps, each token chosen on the device (and
    read back to the host with host_sync, as the engine does)."""
    saved = lm.graphs
    lm.graphs = saved if graphs else None
    try:
        device = lm.device
        cache = KVCache.for_model(lm.model, prompt_len + n + 40)  # room for a padded pass at every step
        prompt = torch.randint(0, min(1000, lm.config.vocab_size), (1, prompt_len), device=device)
        token = lm.forward(prompt, cache, last_only=True)[0, -1].argmax().reshape(1, 1)
        for _ in range(4):  # warm-up: captures, workspaces
            token = lm.forward(token, cache, last_only=True)[0, -1].argmax().reshape(1, 1)
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


class Bench:
    """The rows measured so far, written to --json after each."""

    def __init__(self, args, device: torch.device, name: str, bw: float):
        self.args, self.device, self.name, self.bw = args, device, name, bw
        self.rows, self.curves, self.steps, self.graphs_off = [], {}, {}, {}
        self.predicted, self.load_27b, self.fit = {}, None, None
        self.figures = Figures()  # decode tok/s by (label, mode)

    def log(self, text: str) -> None:
        print(f"gpu_bench: {text}", file=sys.stderr, flush=True)

    def measure(self, label, lm, source, modes=("graphs", "no sync"), n=None, runs=None, v_curve=True) -> None:
        """One row: decode tok/s in each mode (the first is how the engine serves it), the roofline, v(k)."""
        n, runs = n or self.args.n, runs or self.args.runs
        per_pass = roofline.pass_bytes(lm.model, 64 + n // 2)
        for mode in modes:
            host_sync, graphs = MODES[mode]
            for _ in range(runs):
                self.figures.add((label, mode), decode_tok_s(lm, n, host_sync, graphs))
        tok_s = {mode: self.figures.median((label, mode)) if mode in modes else None for mode in MODES}
        if v_curve:
            prompt = torch.randint(0, lm.config.vocab_size, (64,)).tolist()
            _, self.curves[label] = roofline.v_curve(lm, prompt, 16, reps=3)
        disabled = lm.graphs.disabled if lm.graphs is not None else None
        if "graphs" in modes and disabled:  # the figures above were eager passes, not graphs
            self.graphs_off[label] = disabled
            self.log(f"CUDA graphs were OFF for {label}: {disabled}")
        served = "graphs" if "graphs" in modes else modes[0]
        self.rows.append({"model": f"{label} ({source})", "served": served, "mb_per_pass": per_pass / 1e6,
                          "eager_tok_s": tok_s["eager"], "graphs_tok_s": tok_s["graphs"],
                          "no_sync_tok_s": tok_s["no sync"], "roofline_tok_s": self.bw / per_pass})
        self.steps[label] = 1 / tok_s[served]
        kernels = ", ".join(sorted(lm.plan.get("linear", {})))
        self.log(f"{label}: {tok_s[served]:.1f} tok/s served ({served}), {kernels}; "
                 f"attention {lm.plan.get('attention', 'PyTorch CPU')}; loaded in {lm.load_seconds:.1f} s")
        self.save()

    def save(self) -> None:
        if not self.args.json:
            return
        with open(self.args.json, "w", encoding="utf-8") as f:
            json.dump({"device": self.name, "torch": torch.__version__, "bandwidth_gb_s": self.bw / 1e9,
                       "decode": self.rows, "v": self.curves, "predicted": self.predicted,
                       "graphs_off": self.graphs_off, "load_27b": self.load_27b, "fit_24gib": self.fit}, f, indent=1)


def default_pair(bench: Bench) -> None:
    args, device = bench.args, bench.device
    for fmt in ("bf16", "int8", "int4"):
        lm, source = load(TARGET, fmt, device, 1024, args.quick)
        bench.measure(f"1.5B {fmt}", lm, source, ("graphs", "no sync", "eager") if fmt == "bf16" else
                      ("graphs", "no sync"))
        del lm
        free(device)
    draft, source = load(DRAFT, "int4", device, 1024, args.quick)
    bench.measure("0.5B int4 (draft)", draft, source, v_curve=False)
    del draft
    free(device)
    draft_step = bench.steps["0.5B int4 (draft)"]
    for fmt in ("bf16", "int8", "int4"):
        label = f"1.5B {fmt}"
        r, v = draft_step / bench.steps[label], bench.curves[label]
        best = max(v, key=lambda k: speedup(expected_length([args.alpha] * k), v[k], k, r))
        length = expected_length([args.alpha] * best)
        s = speedup(length, v[best], best, r)
        bench.predicted[fmt] = {"r": r, "k": best, "expected_length": length, "v_k": v[best], "speedup": s,
                                "tok_s": s / bench.steps[label]}
    bench.save()


def class_27b(bench: Bench) -> None:
    """The dense stand-in (graphed) and the hybrid as Qwen3.5-27B is (eager, as served), each in int4."""
    args, device = bench.args, bench.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    lm, source = load(DENSE_27B, "int4", device, 1024, args.quick)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
    bench.load_27b = {"load_s": lm.load_seconds, "peak_gib": peak,
                      "weights_gib": sum(t.numel() * t.element_size() for t in lm.model.buffers()) / 2**30}
    bench.measure("27B dense stand-in int4", lm, source, runs=max(1, args.runs - 1))
    del lm
    free(device)
    lm, source = load(HYBRID_27B, "int4", device, 1024, args.quick)
    bench.measure("27B hybrid int4 (eager)", lm, source, ("eager",), n=max(8, args.n // 4), runs=1)
    del lm
    free(device)
    draft_step = bench.steps["0.5B int4 (draft)"]
    for label in ("27B dense stand-in int4", "27B hybrid int4 (eager)"):
        v, r, plain = bench.curves[label], draft_step / bench.steps[label], 1 / bench.steps[label]
        k = min(FIT_K, max(v))
        s = speedup(4.8, v[k], k, r)
        bench.predicted[label] = {"r": r, "k": k, "expected_length": 4.8, "v_k": v[k], "speedup": s,
                                  "tok_s": s * plain}
    bench.save()


@torch.inference_mode()
def fit_24gib(bench: Bench) -> None:
    """The Q4_K_M-shaped 27B stand-in and the 0.5B-class draft, loaded and run with the process held to FIT_GIB of
    the device: a prefill to near the context's end, then FIT_ROUNDS rounds of FIT_K drafts and a verification."""
    args, device = bench.args, bench.device
    context = FIT_CONTEXT if not args.quick else 512
    cfg = roofline.STAND_INS[DENSE_27B]
    types = {n: t for n, t in roofline.q4_k_m_types(cfg).items() if n != "tok_embeddings.weight"}  # table: int8
    specs = [memory.ModelSpec("target", "27B dense stand-in, Q4_K_M-shaped", cfg, "mixed", types),
             memory.ModelSpec("draft", "0.5B-class", roofline.STAND_INS[DRAFT], "int4")]
    plan = memory.plan(specs, context, torch.device("cuda"), FIT_GIB * 2**30, FIT_GIB * 2**30)
    fit = {"gib": FIT_GIB, "context": context, "plan_gib": {i.what: i.nbytes / 2**30 for i in plan.items},
           "plan_total_gib": plan.used / 2**30, "stage": "loading"}
    bench.fit = fit
    bench.log("memory plan for the 24 GiB fit:\n" + "\n".join(plan.lines()))
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, FIT_GIB * 2**30 / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _fit_run(bench, fit, context, types)
    except torch.OutOfMemoryError as e:
        fit["failed"] = f"out of memory while {fit['stage']}: {str(e).splitlines()[0][:300]}"
        bench.log(f"the 24 GiB fit FAILED: {fit['failed']}")
    finally:
        if device.type == "cuda":
            fit["allocated_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            fit["reserved_peak_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        bench.save()


def _fit_run(bench: Bench, fit: dict, context: int, types: dict) -> None:
    device, quick = bench.device, bench.args.quick
    target, _ = load(DENSE_27B, "mixed", device, context, quick, source_types=None if quick else types)
    fit["stage"] = "loading the draft"
    draft, _ = load(DRAFT, "int4", device, context, quick)
    fit["stage"] = "allocating the caches"
    caches = KVCache.for_model(target.model, context), KVCache.for_model(draft.model, context)
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    prompt = torch.randint(0, vocab, (1, context - 64 - FIT_ROUNDS * (FIT_K + 1)), device=device)
    fit["stage"] = "prefilling"
    t0 = time.perf_counter()
    target.prefill(prompt, caches[0])
    draft.prefill(prompt, caches[1])
    roofline.sync(device)
    fit["prefill_s"] = time.perf_counter() - t0
    fit["stage"] = "decoding"
    token = prompt[:, -1:]
    t0 = time.perf_counter()
    for _ in range(FIT_ROUNDS):  # FIT_K draft steps, then one verification of FIT_K + 1 rows, all accepted
        drafts = [token]
        for _ in range(FIT_K):
            logits = draft.forward(drafts[-1], caches[1], last_only=True)  # (1, 1, V)
            drafts.append(logits[:, -1].argmax(-1, keepdim=True).clamp_max(vocab - 1))
        target.forward(torch.cat(drafts, dim=1), caches[0])
        token = drafts[-1]
    roofline.sync(device)
    fit |= {"rounds_s": time.perf_counter() - t0, "stage": "done", "positions": caches[0].length,
            "graphs_off": target.graphs.disabled if target.graphs is not None else None}  # a capture's OOM hides there
    bench.log(f"the 24 GiB fit: ran to {caches[0].length} of {context} positions")


def print_table(bench: Bench) -> None:
    width = max([len(r["model"]) for r in bench.rows] + [20])
    print(f"\n{'plain decode, tok/s':{width}} {'MB/pass':>8} {'eager':>7} {'graphs':>7} {'no sync':>8} {'limit':>7} "
          f"{'% served':>8} {'% no sync':>9}")
    for row in bench.rows:
        cells = [f"{row[c]:{w}.1f}" if row[c] else f"{'-':>{w}}" for c, w in
                 (("eager_tok_s", 7), ("graphs_tok_s", 7), ("no_sync_tok_s", 8))]
        served = row["graphs_tok_s"] if row["served"] == "graphs" else row["eager_tok_s"]
        nosync = f"{100 * row['no_sync_tok_s'] / row['roofline_tok_s']:8.0f}%" if row["no_sync_tok_s"] else \
            f"{'-':>9}"
        print(f"{row['model']:{width}} {row['mb_per_pass']:8.0f} {' '.join(cells)} {row['roofline_tok_s']:7.0f} "
              f"{100 * served / row['roofline_tok_s']:7.0f}% {nosync}")
    if bench.curves:
        print("\nv(k), each pass padded to 16 rows on CUDA:")
        for label, v in bench.curves.items():
            print(f"  {label:26} " + " ".join(f"{v[k]:.2f}" for k in sorted(v)))
    if bench.predicted:
        print(f"\npredicted with the 0.5B int4 draft (alpha = {bench.args.alpha} a draft for the default pair; "
              "4.8 tokens a round for the 27B rows):")
        for label, p in bench.predicted.items():
            print(f"  {label:26} r = {p['r']:.3f}  k = {p['k']:2}  E[L] = {p['expected_length']:.2f}  "
                  f"v(k) = {p['v_k']:.2f}  speed-up {p['speedup']:.2f}x -> {p['tok_s']:.0f} tok/s")
    if bench.load_27b:
        b = bench.load_27b
        print(f"\n27B dense stand-in load: {b['load_s']:.1f} s module by module, peak {b['peak_gib']:.2f} GiB "
              f"allocated for {b['weights_gib']:.2f} GiB of weights")
    if bench.fit:
        f = bench.fit
        print(f"\n{FIT_GIB} GiB fit (process held to {FIT_GIB} GiB), {f['context']} positions: "
              + (f"FAILED: {f['failed']}" if "failed" in f else
                 f"ran to {f.get('positions')} positions, prefill {f.get('prefill_s', 0):.1f} s, "
                 f"{FIT_ROUNDS} rounds {f.get('rounds_s', 0):.2f} s"
                 + (f"; graphs OFF: {f['graphs_off']}" if f.get("graphs_off") else "")))
        print(f"  plan {f['plan_total_gib']:.2f} GiB ("
              + ", ".join(f"{k} {v:.2f}" for k, v in f["plan_gib"].items()) + ")"
              + (f"; allocator peak {f['allocated_peak_gib']:.2f} GiB allocated, {f['reserved_peak_gib']:.2f} "
                 "reserved" if "allocated_peak_gib" in f else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=256, help="tokens decoded per timing (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--alpha", type=float, default=0.75, help="acceptance per drafted token for the default pair's "
                                                              "prediction (default: %(default)s)")
    ap.add_argument("--skip-27b", action="store_true", help="leave out the 27B-class rows and the 24 GiB fit")
    ap.add_argument("--quick", action="store_true", help="tiny stand-ins for every model (the CPU rehearsal)")
    ap.add_argument("--json", help="write the table here as JSON too, after every row")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: PyTorch sees no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bench = Bench(args, device, name, roofline.bandwidth(device))
    bench.log(f"{name}, torch {torch.__version__}, bandwidth {bench.bw / 1e9:.0f} GB/s (copy/read, measured now)")
    bench.save()
    try:
        default_pair(bench)
        if not args.skip_27b:
            class_27b(bench)
            fit_24gib(bench)
    finally:
        print_table(bench)
    if bench.graphs_off:
        print(f"\ngpu_bench: CUDA graphs were off for {', '.join(bench.graphs_off)}: those figures are eager passes")
        return 1
    return 1 if bench.fit and "failed" in bench.fit else 0


if __name__ == "__main__":
    raise SystemExit(main())
