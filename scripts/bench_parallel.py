#!/usr/bin/env python3
"""Several requests at once against llama.cpp, on the same GGUF files and machine, in one run.

For 1, 2, 4 and 8 concurrent streams (each a different bundled prompt, as an agent's sub-requests are; greedy, a
fixed number of tokens each): quickdraft serve (the default pair, --parallel 8) with speculation on (its default:
the 0.5B draft and n-gram, k chosen per step) and off (the request's {"speculative": {"draft_max": 0}}), and
llama-server -np N plain and with the 0.5B draft (-md). Prints aggregate tok/s (all tokens / wall time) and each
stream's own decode tok/s, medians over the cells (a cell: N streams started together; --cells of them per N).

    .venv/bin/python scripts/bench_parallel.py [-n 256] [--cells 2] [--streams 1,2,4,8]

--mixed: the mixed case instead: four requests (a code task, a Chinese question, an extraction, a ~1,000-token text to
summarise; -n greedy tokens each) answered one after another, then the same four sent at once, against llama-server
-np 4 (its prompt cache on) on the same GGUF: the aggregate tok/s at once, each request's cache_n (prompt tokens taken
from the cache) and decode tok/s at once, and whether each answer at once equals its answer alone.

    .venv/bin/python scripts/bench_parallel.py --mixed [-n 128] [--cells 2]

--agents N: N agents at once, each its own conversation (quickdraft/tools/conversation.py's agent script: the shared
system prompt with tool definitions, then --turns turns, each a tool result of a few hundred tokens of its own and a
question, the whole history resent; -n greedy tokens a turn), all N at once on conversations new to the server, then
each agent again alone: quickdraft serve (the default pair, --parallel N; and with --draft none: drafting off) against
llama-server -np N (its prompt cache on). The wall time of all N at once, time to first token per turn (median and
p90), prompt tokens taken from the cache, and whether each agent's answers at once equal its answers alone.

    .venv/bin/python scripts/bench_parallel.py --agents 4 [--turns 5] [-n 48]

--cycling N: memory under many conversations: quickdraft serve (--parallel 4, --cache-ram as given) answers N
distinct conversations (each a different stretch of a long text, ~400 prompt tokens), four at a time, then every one's
second turn (its history resent), so the kept slots cycle through more conversations than --cache-ram holds. After
each request: the server's resident memory (VmRSS) and its /metrics (prefix_cache_bytes, evictions); at the end the
second turns' cache_n (prompt tokens taken from a kept slot).

    .venv/bin/python scripts/bench_parallel.py --cycling 32 [-n 16] [--cache-ram 1G]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quickdraft.tools import conversation, llamacpp, prompts as bundled, remote  # noqa: E402
from quickdraft.tools.servers import LlamaServer, ServerProcess  # noqa: E402
from quickdraft.weights import hub  # noqa: E402
from quickdraft.tools.runs import Figures, machine  # noqa: E402


def cells(endpoint: remote.Endpoint, texts: list[str], n: int, streams: int, count: int) -> dict:
    """`count` cells of `streams` streams at once, the prompts in a cycle from a different start each cell."""
    figures = Figures()  # "aggregate" by cell; "stream" (decode tok/s) and "ttft" by stream
    for c in range(count):
        batch = [texts[(c * streams + i) % len(texts)] for i in range(streams)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            replies = list(pool.map(lambda text: endpoint.complete(text, n), batch))
        figures.add("aggregate", sum(r.n for r in replies) / (time.perf_counter() - t0))
        for r in replies:
            figures.add("stream", r.decode_tok_s)
            figures.add("ttft", r.ttft_s)
    return {key: figures.median(key) for key in ("aggregate", "stream", "ttft")}


EXTRACTION = ("Extract every person's name and the date they joined as a JSON list of objects with keys name and date: "
              "Alice joined the team on 3 May 2021, Bob on 14 February 2022, and Carol, who had interned the year "
              "before, on 7 June 2023.")


def mixed_texts() -> dict[str, str]:
    return {"code": bundled.text("code-en"), "question": bundled.text("qa-zh"), "extraction": EXTRACTION,
            "summary": "Summarize the following text in three sentences:\n\n" + bundled.text("long-1k")[:4000]}


def mixed(name: str, endpoint: remote.Endpoint, n: int, count: int, figures: Figures) -> None:
    """`count` cells: the four answered alone, then together; figures by (name, figure) and (name, request, figure)."""
    texts = mixed_texts()
    for _ in range(count):
        alone = {key: endpoint.complete(text, n) for key, text in texts.items()}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(texts)) as pool:
            together = dict(zip(texts, pool.map(lambda text: endpoint.complete(text, n), texts.values())))
        wall = time.perf_counter() - t0
        figures.add((name, "aggregate"), sum(r.n for r in together.values()) / wall)
        figures.add((name, "one by one"), sum(r.n for r in alone.values()) / sum(r.seconds for r in alone.values()))
        for key, r in together.items():
            figures.add((name, key, "cache_n"), r.cache_n)
            figures.add((name, key, "decode"), r.decode_tok_s)
            figures.add((name, key, "same"), float(r.text == alone[key].text))
        print(f"bench_parallel --mixed: {name}: aggregate {figures.samples[name, 'aggregate'][-1]:.2f} tok/s",
              file=sys.stderr, flush=True)


def main_mixed(args) -> int:
    print(f"machine: {machine()}", flush=True)
    target = hub.model_path(hub.DEFAULT_TARGET)
    figures, names = Figures(), ["quickdraft (default)"]
    server = ServerProcess("-m", hub.DEFAULT_TARGET, "--ctx", "8192", "--parallel", "4", startup_timeout=600)
    try:
        endpoint = remote.Endpoint(server.base_url)
        endpoint.check()
        endpoint.complete("Hello", 4)  # warm-up
        mixed(names[0], endpoint, args.n, args.cells, figures)
    finally:
        server.stop()
    if not args.skip_llama:
        names.append("llama-server -np 4")
        llama = LlamaServer(llamacpp.server_binary(), "-m", str(target), "-c", "8192", "-np", "4")
        try:
            endpoint = remote.Endpoint(llama.url)
            endpoint.check()
            endpoint.complete("Hello", 4)
            mixed(names[1], endpoint, args.n, args.cells, figures)
        finally:
            llama.stop()
    keys = list(mixed_texts())
    print(f"\nfour requests of {args.n} greedy tokens, alone then at once; medians over {args.cells} cells")
    columns = " ".join(f"{k + ' cache_n/tok/s/same':>28}" for k in keys)
    print(f"{'deployment':22} {'one by one':>10} {'at once':>8} {columns}")
    for name in names:
        row = " ".join(f"{figures.median((name, k, 'cache_n')) or 0:10.0f} {figures.median((name, k, 'decode')):8.2f} "
                       f"{figures.median((name, k, 'same')):8.2f}" for k in keys)
        print(f"{name:22} {figures.median((name, 'one by one')):10.2f} {figures.median((name, 'aggregate')):8.2f} {row}")
    ratio = figures.ratio((names[0], "aggregate"), (names[-1], "aggregate"))
    if len(names) > 1 and ratio:
        print(f"at once: quickdraft {ratio:.2f}x llama-server -np 4's aggregate")
    return 0


def agent_steps(agent: int, turns: int) -> tuple[list[dict], list[list[dict]]]:
    """Agent `agent`'s conversation: the agent script's opening (shared by every agent, as one framework's agents share
    their system prompt), and its turns, each tool result its own."""
    opening, steps = conversation.script("agent", turns)
    return opening, [[{**m, "content": f"[agent {agent}, task {i}] " + m["content"]} for m in step]
                     for i, step in enumerate(steps)]


def agent_run(endpoint: remote.Endpoint, agent: int, turns: int, n: int) -> list[remote.Reply]:
    """One agent's turns, each request its whole history, each answer joining it."""
    messages, steps = agent_steps(agent, turns)
    replies = []
    for step in steps:
        messages = messages + step
        r = endpoint.complete(messages, n)
        replies.append(r)
        messages = messages + [{"role": "assistant", "content": r.text}]
    return replies


def agents(name: str, endpoint: remote.Endpoint, count: int, turns: int, n: int) -> dict:
    """The agents all at once, each conversation new to the server (only the system prompt they share can be in its
    cache), then each again alone, one after another: the figures of the run at once, and whether each answer at once
    is the answer alone."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        together = list(pool.map(lambda a: agent_run(endpoint, a, turns, n), range(count)))
    wall = time.perf_counter() - t0
    alone = [agent_run(endpoint, a, turns, n) for a in range(count)]
    ttft = sorted(r.ttft_s for run in together for r in run)
    same = sum(r.text == q.text for run, ref in zip(together, alone) for r, q in zip(run, ref))
    out = {"wall_s": wall, "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
           "cache_n": [[r.cache_n for r in run] for run in together], "same": same, "answers": len(ttft)}
    print(f"bench_parallel --agents: {name}: all at once in {wall:.1f} s, TTFT p50 {out['ttft_p50']:.2f} s, p90 "
          f"{out['ttft_p90']:.2f} s", file=sys.stderr, flush=True)
    return out


def main_agents(args) -> int:
    print(f"machine: {machine()}", flush=True)
    count, target = args.agents, hub.model_path(hub.DEFAULT_TARGET)
    results = {}
    for name, draft in (("quickdraft (default)", "auto"), ("quickdraft drafting off", "none")):
        if draft not in args.drafts.split(","):
            continue
        server = ServerProcess("-m", hub.DEFAULT_TARGET, "--ctx", "8192", "--parallel", str(count), "--draft", draft,
                               startup_timeout=600)
        try:
            endpoint = remote.Endpoint(server.base_url)
            endpoint.check()
            endpoint.complete("Hello", 4)  # warm-up
            results[name] = agents(name, endpoint, count, args.turns, args.n)
        finally:
            server.stop()
    if not args.skip_llama:
        name = f"llama-server -np {count}"
        llama = LlamaServer(llamacpp.server_binary(), "-m", str(target), "-c", str(8192 * count), "-np", str(count))
        try:
            endpoint = remote.Endpoint(llama.url)
            endpoint.check()
            endpoint.complete("Hello", 4)
            results[name] = agents(name, endpoint, count, args.turns, args.n)
        finally:
            llama.stop()
    print(f"\n{count} agents x {args.turns} turns ({args.n} greedy tokens a turn, the whole history resent), all at "
          "once on new conversations, then each again alone")
    print(f"{'deployment':22} {'at once, s':>11} {'TTFT p50':>9} {'p90':>7} {'same as alone':>14}")
    for name, r in results.items():
        print(f"{name:22} {r['wall_s']:11.1f} {r['ttft_p50']:8.2f}s {r['ttft_p90']:6.2f}s {r['same']:>9}/{r['answers']}")
        print(f"  {name}: prompt tokens from the cache, by agent and turn: {r['cache_n']}")
    names = list(results)
    if len(names) > 2:  # (the default, drafting off, llama-server)
        ours, off, theirs = results[names[0]], results[names[1]], results[names[2]]
        print(f"at once: quickdraft in {ours['wall_s'] / theirs['wall_s']:.2f}x llama-server's wall time "
              f"({ours['wall_s'] / off['wall_s']:.2f}x its own drafting off's); TTFT p50 {ours['ttft_p50']:.2f} s "
              f"against {theirs['ttft_p50']:.2f} s, p90 {ours['ttft_p90']:.2f} s against {theirs['ttft_p90']:.2f} s")
    return 0


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux: /proc/PID/status VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main_cycling(args) -> int:
    print(f"machine: {machine()}", flush=True)
    n_conv = args.cycling
    text = bundled.text("long-1k")
    starts = [(i * 997) % max(len(text) - 1600, 1) for i in range(n_conv)]
    firsts = [f"Conversation {i}. Summarise this passage in two sentences:\n\n{text[s:s + 1500]}"
              for i, s in enumerate(starts)]
    server = ServerProcess("-m", hub.DEFAULT_TARGET, "--ctx", "4096", "--parallel", "4", "--cache-ram",
                           args.cache_ram, startup_timeout=600)
    samples = []  # (request, rss, prefix_cache_bytes, evictions)
    try:
        endpoint = remote.Endpoint(server.base_url)
        endpoint.check()
        endpoint.complete("Hello", 4)
        base = rss_bytes(server.pid)
        print(f"server RSS after load and a warm-up: {base / 2**30:.2f} GiB; --cache-ram {args.cache_ram}",
              flush=True)

        def turn(messages):
            reply = endpoint.complete(messages, args.n)
            samples.append((len(samples), rss_bytes(server.pid), metric(server.url, "quickdraft_prefix_cache_bytes"),
                            metric(server.url, "quickdraft_prefix_cache_evictions")))
            return reply

        histories = [[{"role": "user", "content": f}] for f in firsts]
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(turn, histories))
        for h, r in zip(histories, replies):
            h += [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Now in one sentence."}]
        print(f"first turns done: RSS {samples[-1][1] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(4) as pool:
            seconds = list(pool.map(turn, histories))
    finally:
        server.stop()
    rss = [s[1] for s in samples]
    kept = [s[2] for s in samples]
    figures = Figures()
    for r in seconds:
        figures.add("cache_n", r.cache_n)
        figures.add("ttft", r.ttft_s)
    print(f"\n{n_conv} conversations x 2 turns ({args.n} greedy tokens each), four at a time, --parallel 4, "
          f"--cache-ram {args.cache_ram}")
    print(f"server RSS: {base / 2**30:.2f} GiB after load; max {max(rss) / 2**30:.2f} GiB; last {rss[-1] / 2**30:.2f} "
          f"GiB; growth at most {(max(rss) - base) / 2**20:.0f} MiB")
    print(f"kept slots' bytes (/metrics prefix_cache_bytes): max {max(kept) / 2**20:.0f} MiB; evictions "
          f"{samples[-1][3]:.0f}")
    print(f"second turns: cache_n median {figures.median('cache_n'):.0f} (min {min(figures.samples['cache_n']):.0f}, "
          f"max {max(figures.samples['cache_n']):.0f}); time to first token median {figures.median('ttft'):.2f} s")
    print("RSS by request: " + " ".join(f"{r / 2**30:.2f}" for r in rss))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=256, help="greedy tokens a stream (default: %(default)s)")
    ap.add_argument("--cells", type=int, default=2, help="cells per stream count (default: %(default)s)")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--mixed", action="store_true", help="the mixed case (see above) instead")
    ap.add_argument("--agents", type=int, default=0, metavar="N", help="N agents at once (see above)")
    ap.add_argument("--turns", type=int, default=5, help="--agents: turns an agent (default: %(default)s)")
    ap.add_argument("--drafts", default="auto,none", help="--agents: quickdraft's columns: auto (the default), none "
                                                           "(drafting off) (default: %(default)s)")
    ap.add_argument("--cycling", type=int, default=0, metavar="N", help="memory under N cycling conversations")
    ap.add_argument("--cache-ram", default="1G", help="--cycling: the server's --cache-ram (default: %(default)s)")
    args = ap.parse_args()
    if args.mixed:
        return main_mixed(args)
    if args.cycling:
        args.n = 16 if args.n == 256 else args.n  # (-n's default is the streams case's)
        return main_cycling(args)
    if args.agents:
        args.n = 48 if args.n == 256 else args.n
        return main_agents(args)
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    counts = [int(x) for x in args.streams.split(",")]
    target, draft = (hub.model_path(a) for a in (hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT))
    texts = [bundled.text(name) for name in bundled.PROMPTS]
    started = time.perf_counter()
    results: dict[tuple[str, int], dict] = {}

    def measure(name: str, endpoint: remote.Endpoint, only: list[int]) -> None:
        endpoint.check()
        endpoint.complete("Hello", 4)  # warm-up: one-off setup outside the measurement
        for streams in only:
            results[(name, streams)] = r = cells(endpoint, texts, args.n, streams, args.cells)
            print(f"bench_parallel: {name}, {streams} streams: aggregate {r['aggregate']:.2f} tok/s, per stream "
                  f"{r['stream']:.2f}, TTFT {r['ttft']:.2f} s", file=sys.stderr, flush=True)

    server = ServerProcess("-m", hub.DEFAULT_TARGET, "--ctx", "4096", "--parallel", str(max(counts)),
                           startup_timeout=600)
    try:
        measure("quickdraft spec on", remote.Endpoint(server.base_url), counts)
        measure("quickdraft spec off", remote.Endpoint(server.base_url, extra={"speculative": {"draft_max": 0}}),
                counts)
    finally:
        server.stop()
    names = ["quickdraft spec on", "quickdraft spec off"]
    if not args.skip_llama:
        binary = llamacpp.server_binary()
        for name, flags in (("llama-server plain", ()), ("llama-server -md 0.5B", ("-md", str(draft), "--spec-type", "draft-simple"))):
            names.append(name)
            for streams in counts:
                llama = LlamaServer(binary, "-m", str(target), "-c", str(2048 * streams), "-np", str(streams), *flags)
                try:
                    measure(name, remote.Endpoint(llama.url), [streams])
                finally:
                    llama.stop()
    print(f"\n{args.n} greedy tokens a stream, each stream a different bundled prompt; medians over {args.cells} "
          "cells per count; aggregate = all streams' tokens / wall time; per stream = a stream's own decode tok/s")
    print(f"{'deployment':24}" + "".join(f" {f'{s} streams: agg / each':>24}" for s in counts))
    for name in names:
        print(f"{name:24}" + "".join(f" {results[(name, s)]['aggregate']:12.2f} / {results[(name, s)]['stream']:8.2f}"
                                     if (name, s) in results else f" {'-':>24}" for s in counts))
    base = results.get(("quickdraft spec off", 1))
    if base:
        best = {s: max(results[(n, s)]["aggregate"] for n in names if (n, s) in results and n.startswith("quickdraft"))
                for s in counts}
        print("quickdraft's best aggregate over its own single-stream plain speed: "
              + ", ".join(f"{s} streams {best[s] / base['aggregate']:.2f}x" for s in counts))
        for s in counts:
            theirs = [results[(n, s)]["aggregate"] for n in names if (n, s) in results and n.startswith("llama")]
            if theirs:
                print(f"{s} streams: quickdraft's best {best[s]:.2f} against llama-server's best {max(theirs):.2f} "
                      f"tok/s ({best[s] / max(theirs):.2f}x)")
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
