#!/usr/bin/env python
"""Conversations and prefill against llama.cpp, on the same GGUF files and machine, in one run.

1. A conversation as a client holds one (quickdraft/tools/conversation.py: a ~1,000-token system prompt, then --turns
   turns, each request the whole history, -n greedy tokens a turn, streamed), against each deployment in turn, alone
   on the machine: quickdraft serve with its default drafting and with drafting off (--draft none) from this checkout,
   and (--old DIR) the default from another checkout
   (the revision before prefix reuse, say), and llama.cpp's llama-server (built once: quickdraft/tools/llamacpp.py) plain and
   with the 0.5B draft (-md), with its defaults (prompt cache on). Time to first token per turn and the whole
   conversation's time.
2. Prefill: prompts of 512, 1,024, 2,048 and 4,000 tokens (the reference text repeated, the same token ids on both
   sides), the default target's prompt processing tok/s: quickdraft's engine (its default format, a cold prefill:
   nothing reused) against llama-server's own prompt_per_second (cache_prompt false), medians of --runs.

Usage: .venv/bin/python scripts/bench_conversation.py [--old /path/to/checkout] [--turns 6] [-n 48] [--runs 3]
       [--kind chat|agent] [--skip-prefill] [--skip-conversation]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

from quickdraft.tools import conversation, llamacpp, remote
from quickdraft.weights import hub
from quickdraft.tools.remote import tls
from quickdraft.tools.servers import LlamaServer, ServerProcess
from quickdraft.tools.runs import Figures, machine

LENGTHS = (512, 1024, 2048, 4000)


def deployments(args, target: Path, draft: Path):
    """(name, start) for each deployment: start() -> (base URL, stop)."""

    def quickdraft(cwd, *flags):
        def start():
            server = ServerProcess("-m", hub.DEFAULT_TARGET, "--ctx", "4096", *flags, startup_timeout=600, cwd=cwd)
            return server.base_url, server.stop
        return start

    def llama(*flags):
        def start():
            server = LlamaServer(llamacpp.server_binary(), "-m", str(target), "-c", "4096", *flags)
            return server.url, server.stop
        return start

    out = []
    if args.old:
        out.append((f"quickdraft serve ({Path(args.old).name})", quickdraft(args.old)))
    out += [("quickdraft serve (this checkout)", quickdraft(None)),
            ("quickdraft serve --draft none", quickdraft(None, "--draft", "none")),
            ("llama-server plain", llama()),
            ("llama-server -md 0.5B", llama("-md", str(draft), "--spec-type", "draft-simple"))]
    return out


def conversations(args, target: Path, draft: Path) -> list:
    runs = []
    for name, start in deployments(args, target, draft):
        print(f"bench_conversation: {name}", file=sys.stderr, flush=True)
        url, stop = start()
        try:
            endpoint = remote.Endpoint(url)
            endpoint.check()
            endpoint.complete("Hello", 4)  # warm-up: one-off setup outside the conversation
            runs.append(conversation.converse(name, conversation.remote_reply(endpoint), args.kind, args.turns,
                                              args.n))
        finally:
            stop()
    return runs


def prompts_of(tokenizer) -> dict[int, list[int]]:
    text = "\n\n".join([conversation.reference_text()] * 6)
    ids = tokenizer.encode(text)
    return {n: ids[:n] for n in LENGTHS}


def prefill(args, target: Path) -> list[tuple[int, float, float, float]]:
    """(prompt tokens, quickdraft's prefill tok/s, llama-server's, their ratio) by prompt length: medians of --runs."""
    import quickdraft
    from quickdraft.config import SamplingParams

    llm = quickdraft.load(hub.DEFAULT_TARGET, "none", context=4096, progress=False)
    prompts = prompts_of(llm.tokenizer)
    figures = Figures()  # prefill tok/s by ("quickdraft" or "llama-server", prompt tokens)
    for n, ids in prompts.items():
        for run in range(args.runs + 1):
            events = list(llm.engine.generate(ids, SamplingParams(max_tokens=1), reuse=False))
            if run:  # the first is a warm-up
                figures.add(("quickdraft", n), events[-1].timings.prefill_tok_s)
        print(f"bench_conversation: quickdraft prefill {n}: {figures.median(('quickdraft', n)):.1f} tok/s",
              file=sys.stderr, flush=True)
    del llm
    server = LlamaServer(llamacpp.server_binary(), "-m", str(target), "-c", "4096")
    try:
        for n, ids in prompts.items():
            for run in range(args.runs + 1):
                reply = httpx.post(f"{server.url}/completion", json={"prompt": ids, "n_predict": 1, "cache_prompt": False,
                                                                     "temperature": 0}, timeout=900, verify=tls()).json()
                if run:  # the first is a warm-up
                    figures.add(("llama-server", n), reply["timings"]["prompt_per_second"])
            print(f"bench_conversation: llama-server prefill {n}: {figures.median(('llama-server', n)):.1f} tok/s",
                  file=sys.stderr, flush=True)
    finally:
        server.stop()
    return [(n, figures.median(("quickdraft", n)), figures.median(("llama-server", n)),
             figures.ratio(("quickdraft", n), ("llama-server", n))) for n in prompts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None, help="another checkout whose quickdraft serve runs first")
    ap.add_argument("--kind", default="chat", choices=["chat", "agent"])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("-n", type=int, default=48, help="greedy tokens a turn (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="prefill runs per length (default: %(default)s)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-conversation", action="store_true")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    target, draft = (hub.model_path(a) for a in (hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT))
    llamacpp.server_binary()  # built before anything is timed
    started = time.perf_counter()
    runs = [] if args.skip_conversation else conversations(args, target, draft)
    rows = [] if args.skip_prefill else prefill(args, target)
    if runs:
        print(conversation.table(runs, args.kind, args.n))
    if rows:
        print(f"\nprefill of the default target, tok/s (medians of {args.runs}; quickdraft in its default format, "
              "a cold prefill; llama-server's prompt_per_second, cache_prompt false)")
        print(f"{'prompt tokens':>14} {'quickdraft':>11} {'llama-server':>13} {'ratio':>6}")
        for n, ours, theirs, ratio in rows:
            print(f"{n:14} {ours:11.1f} {theirs:13.1f} {ratio:6.2f}x")
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
