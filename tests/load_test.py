"""Load test of `quickdraft serve`: many concurrent streams on loopback, some cancelled mid-way.

Checks that every completed stream carries exactly the answer its prompt gets alone (none lost, none mixed
with another), that the server's memory returns to its baseline, and that it still answers /health.
Prints requests/s and latency percentiles. Run: python -m tests.load_test [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx
import psutil

from quickdraft.tools.servers import ServerProcess

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level?",
    "List three primary colors.",
    "Explain recursion in one sentence.",
    "写一句关于春天的诗。",
    "Translate 'good morning' into French.",
    "What does HTTP stand for?",
    "Give an example of a prime number greater than 10.",
]


def body(i: int, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


async def reference_answers(client: httpx.AsyncClient, url: str, max_tokens: int) -> list[str]:
    answers = []
    for i in range(len(PROMPTS)):
        r = await client.post(url, json=body(i, max_tokens, stream=False))
        r.raise_for_status()
        answers.append(r.json()["choices"][0]["message"]["content"])
    return answers


async def one_stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, cancel_after: int | None):
    """-> (i, text, finish_reason or 'cancelled', seconds, saw [DONE])"""
    start, text, finish, done = time.perf_counter(), "", None, False
    async with client.stream("POST", url, json=body(i, max_tokens, stream=True)) as r:
        r.raise_for_status()
        pieces = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            pieces += 1
            if cancel_after is not None and pieces >= cancel_after:
                return i, text, "cancelled", time.perf_counter() - start, False
    return i, text, finish, time.perf_counter() - start, done


async def wait_idle(client: httpx.AsyncClient, base: str, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        health = (await client.get(base + "/health")).json()
        if (not health["running"] and health["waiting"] == 0) or time.time() > deadline:
            return health
        await asyncio.sleep(0.2)


async def run_load(server: ServerProcess, requests: int, cancel: int, max_tokens: int) -> dict:
    url = server.base_url + "/chat/completions"
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    proc = psutil.Process(server.pid)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        answers = await reference_answers(client, url, max_tokens)
        await reference_answers(client, url, max_tokens)  # warm: allocator pools and caches settle
        rss_before = proc.memory_info().rss
        cancelled = set(range(0, requests, max(1, requests // cancel))[:cancel]) if cancel else set()
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, url, i, max_tokens, 2 if i in cancelled else None) for i in range(requests)),
            return_exceptions=True)
        wall = time.perf_counter() - start
        health = await wait_idle(client, server.url)
        again = await reference_answers(client, url, max_tokens)
        rss_after = proc.memory_info().rss
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    finished = [r for r in results if not isinstance(r, BaseException) and r[2] != "cancelled"]
    mixed = [r[0] for r in finished if r[1] != answers[r[0] % len(PROMPTS)] or not r[4] or r[2] is None]
    latencies = sorted(r[3] for r in finished)
    return {
        "requests": requests,
        "completed": len(finished),
        "cancelled": len(cancelled),
        "lost": len(errors),
        "errors": errors[:5],
        "mismatched": mixed,
        "answers_unchanged_after": again == answers,
        "wall_s": wall,
        "requests_per_s": len(finished) / wall,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else None,
        "rss_before_mib": rss_before / 2**20,
        "rss_after_mib": rss_after / 2**20,
        "health_after": health,
    }


def failures(report: dict, rss_growth_mib: float) -> list[str]:
    problems = []
    if report["lost"]:
        problems.append(f"{report['lost']} requests failed: {report['errors']}")
    if report["completed"] + report["cancelled"] != report["requests"]:
        problems.append("some requests neither completed nor were cancelled")
    if report["mismatched"]:
        problems.append(f"requests {report['mismatched']} got text other than their prompt's answer")
    if not report["answers_unchanged_after"]:
        problems.append("answers changed after the load")
    if report["rss_after_mib"] - report["rss_before_mib"] > rss_growth_mib:
        problems.append(f"memory grew {report['rss_after_mib'] - report['rss_before_mib']:.0f} MiB")
    if report["health_after"].get("status") != "ok":
        problems.append(f"/health after the load: {report['health_after']}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--cancel", type=int, default=8, help="streams closed by the client after 2 chunks")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rss-growth-mib", type=float, default=64, help="allowed memory growth over the run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with ServerProcess("-m", args.model, "--draft", args.draft, "--ngram", "--ctx", "512",
                       "--max-queue", str(args.requests)) as server:
        report = asyncio.run(run_load(server, args.requests, args.cancel, args.max_tokens))
        report["server_alive"] = server.proc.poll() is None
    problems = failures(report, args.rss_growth_mib)
    report["problems"] = problems
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['requests']} streams ({report['cancelled']} cancelled by the client): "
              f"{report['completed']} completed, {report['lost']} lost, {len(report['mismatched'])} mismatched")
        print(f"{report['requests_per_s']:.2f} requests/s over {report['wall_s']:.1f} s; latency p50 "
              f"{report['latency_p50_s']:.2f} s, p95 {report['latency_p95_s']:.2f} s")
        print(f"server RSS {report['rss_before_mib']:.0f} MiB before, {report['rss_after_mib']:.0f} MiB after")
        print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
