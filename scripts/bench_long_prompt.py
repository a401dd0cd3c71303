"""A long prompt beside a short one, against a real server (issue: a long prompt must not hold the server).

Starts `quickdraft serve` (default: SmolLM2-135M with itself as the draft, --ctx 16384, the attack run's setup), then
`--tries` times: a ~6,000-token prompt is sent, and `--after` seconds into its prefill a short streamed request; prints
the short request's time to first token (median, p90) and the long one's. Then `--tries` times: a client sends the long
prompt and leaves after `--after` seconds; prints how long the engine stays busy after it left (median, p90).

    .venv/bin/python scripts/bench_long_prompt.py --tries 10
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

from quickdraft.tools.runs import machine
from quickdraft.tools.servers import ServerProcess

SENTENCE = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. "


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("quickdraft_num_requests_running ")))


def first_token(url: str, prompt: str, out: dict, key: str) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "cache_prompt": False}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                out[key] = time.perf_counter()
                return


def p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, -(-9 * len(xs) // 10) - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("--ctx", default="16384")
    ap.add_argument("--repeat", type=int, default=330, help="sentences in the long prompt (330: about 6,000 tokens)")
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--after", type=float, default=2.0, help="seconds into the long prefill the short one is sent")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)
    with ServerProcess("-m", args.m, "--draft", args.draft, "--ctx", args.ctx) as server:
        url = server.url
        tokens = httpx.post(url + "/v1/completions", json={"prompt": SENTENCE * args.repeat, "max_tokens": 1},
                            timeout=900).json()["usage"]["prompt_tokens"]
        short, long = [], []
        for i in range(args.tries):
            times: dict = {}
            prompt = f"Try {i}. " + SENTENCE * args.repeat  # a prompt no slot holds
            t0 = time.perf_counter()
            t = threading.Thread(target=first_token, args=(url, prompt, times, "long"))
            t.start()
            time.sleep(args.after)
            sent = time.perf_counter()
            first_token(url, "Say hello.", times, "short")
            t.join()
            short.append(times["short"] - sent)
            long.append(times["long"] - t0)
            print(f"try {i}: short request's first token {short[-1]:.2f} s after it was sent; the long prompt's "
                  f"{long[-1]:.1f} s after it was", flush=True)
        print(f"\n{tokens}-token prompt prefilling, a short request sent {args.after:.0f} s into it: first token "
              f"median {statistics.median(short):.2f} s, p90 {p90(short):.2f} s; the long prompt's own first token "
              f"median {statistics.median(long):.1f} s")
        busy = []
        for i in range(args.tries):
            body = {"prompt": f"Leave {i}. " + SENTENCE * args.repeat, "max_tokens": 4, "cache_prompt": False}
            try:
                httpx.post(url + "/v1/completions", json=body, timeout=args.after)
            except httpx.TimeoutException:
                pass  # the client is gone
            left = time.perf_counter()
            while running(url) > 0 and time.perf_counter() - left < 120:
                time.sleep(0.02)
            busy.append(time.perf_counter() - left)
        print(f"a client that leaves {args.after:.0f} s into the prefill: the engine free "
              f"{statistics.median(busy):.2f} s later (median), p90 {p90(busy):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
