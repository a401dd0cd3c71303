#!/usr/bin/env python
"""quickdraft against llama.cpp on the same GGUF file, prompts and machine, in one run.

llama.cpp comes from the PyPI package llama-cpp-python (not a quickdraft dependency: install it into the
venv first, `.venv/bin/pip install llama-cpp-python`, which compiles llama.cpp for this CPU). Both decode the
bundled prompts (chat template applied, the same token ids) greedily for -n tokens, end-of-generation
ignored; decode tok/s is counted from the first generated token on (prompt processing excluded), medians
of --runs with the engines taking turns (the order rotated each run). llama.cpp runs plain and with prompt-lookup
speculation (the speculation llama-cpp-python offers), and with --server also as llama.cpp's own llama-server (built
once from the same vendored source: quickdraft/tools/llamacpp.py), plain and speculating with the draft model (`-md`,
its defaults: its best speculation on the CPU); quickdraft runs plain in its default target format (`mixed`: int4 where
the file holds 4-bit blocks, int8 elsewhere) and in int4, and speculative with the default pair (that target,
int4 draft, n-gram lookup in front; --draft for another model's): with the adaptive policy as `generate` and
`serve` run it, at a fixed --k, and with the int4 target (`--weights int4`), adaptive.

Usage: .venv/bin/python scripts/bench_llamacpp.py [-m ALIAS] [--draft DRAFT] [--prompts code-en,qa-en] [-n 96]
       [--runs 3] [--k 8] [--server] [--draft-vocab N]
  e.g. -m gemma3-270m --draft ngram (a family without a draft model in the defaults)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from quickdraft.tools.runs import Figures, machine, rotated


def llama_decode(llm, prompt: list[int], n: int) -> tuple[float, list[int]]:
    llm.reset()
    out, t_first = [], None
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(token)
        if len(out) == n:
            break
    return (len(out) - 1) / (time.perf_counter() - t_first), out


def server_decode(url: str, prompt: list[int], n: int) -> tuple[float, list[int], float | None]:
    """llama-server's greedy completion of the token ids: its own generation tok/s, the tokens, the share of its
    drafts it accepted (None without a draft)."""
    import httpx

    from quickdraft.tools.remote import tls

    reply = httpx.post(f"{url}/completion", json={
        "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "repeat_penalty": 1.0, "return_tokens": True,
        "cache_prompt": False, "ignore_eos": True}, timeout=600, verify=tls()).json()
    t = reply["timings"]
    drafted = t.get("draft_n") or 0
    return t["predicted_per_second"], reply["tokens"], (t.get("draft_n_accepted", 0) / drafted if drafted else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="the target, an alias (default: the default target)")
    ap.add_argument("--draft", default=None, help="the speculative rows' drafter (default: n-gram + the default "
                    "draft for the default target, n-gram for another)")
    ap.add_argument("--prompts", default="code-en,qa-en,summary-en,code-zh")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", type=int, default=8, help="quickdraft's fixed k for the speculative row")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--server", action="store_true", help="also llama.cpp's llama-server, plain and with the draft "
                    "model (-md): built from the vendored source on first use (about 10 minutes)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="also the default pair with this --draft-vocab")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("bench_llamacpp: llama-cpp-python is not installed: .venv/bin/pip install llama-cpp-python",
              file=sys.stderr)
        return 2
    import torch

    import quickdraft
    from quickdraft.config import SamplingParams, SpeculationConfig
    from quickdraft.tools.prompts import encoded
    from quickdraft.weights import hub

    torch.set_num_threads(args.threads)
    model = args.model or hub.DEFAULT_TARGET
    path = str(hub.model_path(model))
    load = dict(device="cpu", dtype="bfloat16", context=1024, progress=False)
    llm = quickdraft.load(model, "none", **load)  # weights auto: mixed where the kernels run
    llm4 = quickdraft.load(model, "none", weights="int4", **load)
    pair = args.draft or (f"ngram+{hub.DEFAULT_DRAFT}" if model == hub.DEFAULT_TARGET else "ngram")
    adaptive, fixed = SpeculationConfig(), SpeculationConfig(draft_max=args.k, adaptive=False)
    target = llm.target
    engines = {
        f"quickdraft plain {target.weights}": llm.engine,
        "quickdraft plain int4": llm4.engine,
        f"quickdraft {pair} adaptive": llm.engine_for(pair, adaptive),
        f"quickdraft {pair} k={args.k}": llm.engine_for(pair, fixed),
        f"quickdraft int4 target {pair} adaptive": llm4.engine_for(pair, adaptive),
    }
    if args.draft_vocab:
        cut = SpeculationConfig(draft_vocab=args.draft_vocab)
        engines[f"quickdraft {pair} adaptive vocab={args.draft_vocab}"] = llm.engine_for(pair, cut)
        engines[f"quickdraft int4 target {pair} adaptive vocab={args.draft_vocab}"] = llm4.engine_for(pair, cut)
    servers = {}
    if args.server:
        from quickdraft.tools import llamacpp
        from quickdraft.tools.servers import LlamaServer

        binary = llamacpp.server_binary()
        servers["llama-server plain"] = LlamaServer(binary, "-m", path)
        if model == hub.DEFAULT_TARGET:
            draft_path = str(hub.model_path(hub.DEFAULT_DRAFT))
            # (this llama.cpp loads a -md draft but drafts only with a --spec-type naming the kind)
            servers[f"llama-server -md {hub.DEFAULT_DRAFT}"] = LlamaServer(binary, "-m", path, "-md", draft_path,
                                                                           "--spec-type", "draft-simple")
        servers["llama-server --spec-type ngram-simple"] = LlamaServer(binary, "-m", path, "--spec-type", "ngram-simple")
    common = dict(model_path=path, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    llamas = {"llama.cpp plain": Llama(**common),
              "llama.cpp prompt lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}
    prompts = encoded(target.tokenizer, args.prompts.split(","))
    params = SamplingParams(max_tokens=args.n, stop_at_eos=False)
    names = list(llamas) + list(servers) + list(engines)
    speeds, accepted = Figures(), Figures()  # decode tok/s, the share of drafts accepted: by (prompt, configuration)
    same = {}
    for p, prompt in prompts.items():
        for c, llm in llamas.items():  # warm-up
            llama_decode(llm, prompt, 8)
        for c, server in servers.items():
            server_decode(server.url, prompt, 8)
        for c, e in engines.items():
            list(e.generate(prompt, SamplingParams(max_tokens=8, stop_at_eos=False)))
        for i in range(args.runs):
            print(f"{p}: run {i + 1}/{args.runs}", file=sys.stderr)
            reference = {}  # each target format's first output this run: every engine of that format must match it
            for c in rotated(names, i):
                if c in llamas:
                    tok_s, out = llama_decode(llamas[c], prompt, args.n)
                    speeds.add((p, c), tok_s)
                elif c in servers:
                    tok_s, out, rate = server_decode(servers[c].url, prompt, args.n)
                    speeds.add((p, c), tok_s)
                    accepted.add((p, c), rate)  # (None without a draft: left out)
                else:
                    e = engines[c]
                    events = list(e.generate(prompt, params))
                    speeds.add((p, c), events[-1].timings.decode_tok_s)
                    if events[-1].stats.rounds:
                        accepted.add((p, c), events[-1].stats.acceptance_rate)
                    tokens = [ev.token for ev in events if ev.token is not None]
                    same[p, c] = tokens == reference.setdefault(e.target.weights, tokens)
    for server in servers.values():
        server.stop()
    print(f"\n{model}: decode tok/s (median of {args.runs}, {args.n} greedy tokens, {args.threads} threads); "
          "x = against llama.cpp's best on that prompt; % = drafts accepted")
    best = {p: max(speeds.median((p, c)) for c in list(llamas) + list(servers)) for p in prompts}
    width = max(len(c) for c in names)
    print(f"{'':{width}} " + " ".join(f"{p:>22}" for p in prompts))
    for c in names:
        cells = []
        for p in prompts:
            x, rate = speeds.median((p, c)), accepted.median((p, c))
            rate = f" {100 * rate:3.0f}%" if rate is not None else "     "
            cells.append(f"{x:6.2f} ({x / best[p]:4.2f}x){rate}")
        print(f"{c:{width}} " + " ".join(f"{x:>22}" for x in cells))
    plain = {w: f"quickdraft plain {w}" for w in (target.weights, "int4")}
    for c in engines:
        if "adaptive" in c:
            own = plain["int4" if "int4 target" in c else target.weights]
            ratios = [speeds.ratio((p, c), (p, own)) for p in prompts]
            print(f"{c} / {own}: " + ", ".join(f"{p} {r:.2f}x" for p, r in zip(prompts, ratios)))
    print("quickdraft speculative output equal to the plain output of its target's format: "
          + ", ".join(f"{p} {'yes' if all(same[p, c] for c in engines) else 'NO'}" for p in prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
