#!/usr/bin/env python
"""The benchmark matrix: decode speed by prompt length x temperature x configuration, quickdraft beside llama.cpp's
llama-server on the same GGUF files, in one run on this machine (named in the printout).

Rows: a prompt (the bundled code-en, about 100 tokens; long-1k; review-5k, about 5,500; review-12k with --prompts) at
temperature 0 (greedy) and 0.7 (seeded). Columns: llama-server plain and with the 0.5B draft (-md), quickdraft with
drafting off, its default (suffix decoding, then the 0.5B draft: the chain auto gives; adaptive k, the draft's window) and, with --profile, what
`quickdraft tune` chose. Each cell: decode tok/s (tokens after the first over the time from the first: a drafter's
catch-up is in it), the median of --runs, configurations taken in turn (rotated each run); every run its own request
with the prompt cached (its cold prefill is the warm-up's: the TTFT column). Ratios: the default against llama-server
plain and against quickdraft's own drafting off; "same": the default's output equals drafting off's, token for token.

--fresh runs each of quickdraft's cells as a user of the command line does: a fresh `quickdraft generate --chat` process
per request (its policy starting from this machine's calibrated prices, not from a warm engine's timings), the prompt
as the user's message; llama-server's columns are left out.

--isa avx2 measures what a CPU without AVX-512 runs, on this one: quickdraft's AVX2 kernels (QUICKDRAFT_ISA=avx2, with
PyTorch's and oneDNN's own ops held to AVX2: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) beside a llama-server built for
AVX2 + FMA only (quickdraft/tools/llamacpp.py ISAS).

Usage: python scripts/bench_matrix.py [--prompts code-en,long-1k,review-5k] [-n 128] [--runs 2] [--profile FILE]
       [--weights int4,int8] [--no-llama] [--fresh] [--isa native|avx2] [--json FILE]
       (llama-server is built on first use: about 10 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import quickdraft
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.tools import prompts as bundled
from quickdraft.tools.remote import tls
from quickdraft.tools.runs import Figures, machine, rotated
from quickdraft.weights import hub

SEED = 1


def ours(engine, prompt: list[int], n: int, temperature: float) -> tuple[float, list[int], float]:
    """decode tok/s, the tokens, TTFT of one request."""
    params = SamplingParams(temperature=temperature, seed=SEED if temperature else None, max_tokens=n,
                            stop_at_eos=False)
    events = list(engine.generate(prompt, params))
    t = events[-1].timings
    return t.decode_tok_s, [e.token for e in events if e.token is not None], t.ttft_s


def fresh(draft: str, text: str, n: int, temperature: float) -> tuple[float, list[int], float]:
    """decode tok/s, the tokens, TTFT of one request in a fresh `quickdraft generate --chat` process."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        command = [str(Path(sys.executable).parent / "quickdraft"), "generate", "--chat", "--prompt-file", f.name,
                   "-n", str(n), "--temp", str(temperature), "--seed", str(SEED), "--ignore-eos", "--json",
                   "--draft", draft]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
    reply = json.loads(out.stdout)
    t = reply["timings"]
    return t["decode_tok_s"], reply["tokens"], t["ttft_s"]


def theirs(server, prompt: list[int], n: int, temperature: float) -> tuple[float, list[int], float]:
    """One request to a llama-server, woken for it: between its requests it is stopped (SIGSTOP), since its threads
    spin-wait after a request and would take the cores from whatever runs next (another server, quickdraft)."""
    server.proc.send_signal(signal.SIGCONT)
    try:
        return _request(server.url, prompt, n, temperature)
    finally:
        server.proc.send_signal(signal.SIGSTOP)


def _request(url: str, prompt: list[int], n: int, temperature: float) -> tuple[float, list[int], float]:
    reply = httpx.post(f"{url}/completion", json={
        "prompt": prompt, "n_predict": n, "temperature": temperature, "seed": SEED, "repeat_penalty": 1.0,
        "top_k": 1 if temperature == 0 else 40, "top_p": 1.0, "min_p": 0.0, "return_tokens": True,
        "cache_prompt": True, "ignore_eos": True}, timeout=3600, verify=tls()).json()
    t = reply["timings"]
    return t["predicted_per_second"], reply["tokens"], t["prompt_ms"] / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="code-en,long-1k,review-5k")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("-n", type=int, default=128, help="tokens a request (end of text ignored)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--profile", type=Path, help="a profile `quickdraft tune` wrote: its configuration as a column")
    ap.add_argument("--no-llama", action="store_true", help="quickdraft's columns alone")
    ap.add_argument("--fresh", action="store_true", help="each quickdraft request in a fresh `quickdraft generate` "
                                                         "process (llama-server's columns left out)")
    ap.add_argument("--weights", help="also the target in these formats (comma-separated), drafting off and default")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: both engines as a CPU without AVX-512 runs them")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.isa == "avx2" and os.environ.get("QUICKDRAFT_ISA") != "avx2":  # before PyTorch reads its own switches
        held = {"QUICKDRAFT_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **held})
    temperatures = [float(t) for t in args.temperatures.split(",")]
    names = args.prompts.split(",")

    llm = quickdraft.load(hub.DEFAULT_TARGET, "none", context=args.ctx, progress=False)
    engines = {"quickdraft plain": llm.engine, "quickdraft default": llm.engine_for("auto", SpeculationConfig())}
    if args.fresh:  # (the loaded engines only encode and name the machine's path)
        args.no_llama, engines = True, {"quickdraft plain": "none", "quickdraft default": "auto"}
    for fmt in args.weights.split(",") if args.weights else ():  # other formats of the target beside the default's
        other = quickdraft.load(hub.DEFAULT_TARGET, "none", context=args.ctx, weights=fmt, progress=False)
        engines[f"quickdraft plain {fmt}"] = other.engine
        engines[f"quickdraft default {fmt}"] = other.engine_for("auto", SpeculationConfig())
    if args.profile:
        from quickdraft.tools.tune import read_profile

        p = read_profile(args.profile)
        spec = SpeculationConfig(draft_max=int(p.get("draft_max", 16)), adaptive=not p.get("fixed_k", True),
                                 p_min=float(p.get("p_min", 0.5)), draft_vocab=int(p.get("draft_vocab", 0)),
                                 tree=int(p.get("draft_tree", 1)))
        engines["quickdraft tuned"] = llm.engine_for(p["draft"], spec)
    servers = {}
    if not args.no_llama:
        from quickdraft.tools import llamacpp
        from quickdraft.tools.servers import LlamaServer

        binary = llamacpp.server_binary(isa=args.isa)
        path, draft = str(hub.model_path(hub.DEFAULT_TARGET)), str(hub.model_path(hub.DEFAULT_DRAFT))
        servers["llama-server plain"] = LlamaServer(binary, "-m", path, "-c", str(args.ctx))
        servers["llama-server -md"] = LlamaServer(binary, "-m", path, "-c", str(args.ctx), "-md", draft,
                                                  "--spec-type", "draft-simple")
        for server in servers.values():
            server.proc.send_signal(signal.SIGSTOP)
    columns = list(servers) + list(engines)
    from quickdraft.runtime.plan import cpu_path

    print(f"machine: {machine()}; {hub.DEFAULT_TARGET} (quickdraft: {llm.target.weights}, {cpu_path(llm.target)[0]}; "
          f"llama-server: its {args.isa} build) with {hub.DEFAULT_DRAFT}; {args.n} tokens a request, medians of "
          f"{args.runs}" + ("; each quickdraft request a fresh process, the prompt as a chat message" if args.fresh else ""),
          flush=True)

    def run_ours(c, prompt, name, n, temperature):
        if args.fresh:
            return fresh(engines[c], bundled.text(name), n, temperature)
        return ours(engines[c], prompt, n, temperature)

    figures, ttft, rows = Figures(), {}, []
    try:
        for name in names:
            prompt = bundled.encoded(llm.tokenizer, [name])[name]
            for c in columns:  # warm-up, and the prompt's cold prefill
                if c in servers:
                    ttft[name, c] = theirs(servers[c], prompt, 8, 0.0)[2]
                elif not args.fresh:  # (a fresh process's request is its own cold prefill: its TTFT)
                    ttft[name, c] = ours(engines[c], prompt, 8, 0.0)[2]
            for temperature in temperatures:
                outputs = {}
                for r in range(args.runs):
                    for c in rotated(columns, r):
                        if c in servers:
                            tok_s, tokens, _ = theirs(servers[c], prompt, args.n, temperature)
                        else:
                            tok_s, tokens, first = run_ours(c, prompt, name, args.n, temperature)
                            ttft.setdefault((name, c), first)
                        figures.add((name, temperature, c), tok_s)
                        outputs.setdefault(c, []).append(tokens)
                row = {"prompt": name, "tokens": len(prompt), "temperature": temperature,
                       **{c: figures.median((name, temperature, c)) for c in columns}}
                rows.append(row)
                cells = " ".join(f"{row[c]:7.2f}" for c in columns)
                default = (name, temperature, "quickdraft default")
                vs_llama = figures.ratio(default, (name, temperature, "llama-server plain")) if servers else None
                vs_plain = figures.ratio(default, (name, temperature, "quickdraft plain"))
                row["default_vs_llama_plain"], row["default_vs_plain"] = vs_llama, vs_plain
                # every quickdraft column's output is its format's drafting-off output, run after run
                row["same"] = all(o == outputs[c.replace("default", "plain").replace("tuned", "plain")][0]
                                  for c in engines for o in outputs[c])
                print(f"{name:10} {len(prompt):6} T={temperature:<3} {cells}  x llama {vs_llama or 0:4.2f}  "
                      f"x plain {vs_plain:4.2f}  same {row['same']}", flush=True)
    finally:
        for server in servers.values():
            server.proc.send_signal(signal.SIGCONT)
            server.stop()
    print("\ncolumns: " + ", ".join(columns))
    print("cold prefill (TTFT of the warm-up, s): " + "; ".join(
        f"{n}: " + ", ".join(f"{c.split()[0]} {c.split()[-1]} {ttft[n, c]:.1f}" for c in columns) for n in names))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "n": args.n, "runs": args.runs, "rows": rows,
                                         "ttft_s": {f"{n}/{c}": v for (n, c), v in ttft.items()},
                                         "time": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
