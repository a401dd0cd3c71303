"""A long prompt beside a short one, against a real server: a long prompt must not hold the server.

Starts `quickdraft serve` (default: SmolLM2-135M with itself as the draft, --ctx 16384, the attack run's setup), then
`--tries` times: a ~6,000-token prompt is sent, and `--after` seconds into its prefill a short streamed request; prints
the short request's time to first token (median, p90); the long request then leaves. Then `--tries` times: a client sends the long
prompt and leaves after `--after` seconds; prints how long the engine stays busy after it left (median, p90).

    .venv/bin/python scripts/bench_long_prompt.py --tries 10
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx

from quickdraft.tools.remote import tls
from quickdraft.tools.runs import Figures, machine
from quickdraft.tools.servers import ServerProcess

SENTENCE = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. "


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30, verify=tls()).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("quickdraft_num_requests_running ")))


def first_token(url: str, prompt: str, out: dict, key: str) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "cache_prompt": False}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900, verify=tls()) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                out[key] = time.perf_counter()
                return


def hold(url: str, prompt: str, held: dict) -> None:
    """A streamed request of prompt, held open until held["response"] is closed."""
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True, "cache_prompt": False}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900, verify=tls()) as r:
            held["response"] = r
            for _ in r.iter_lines():
                pass
    except (httpx.HTTPError, RuntimeError):  # closed under it: the client left
        pass


def wait_idle(url: str, limit: float = 120) -> float:
    """Seconds until the server runs no request."""
    t0 = time.perf_counter()
    while running(url) > 0 and time.perf_counter() - t0 < limit:
        time.sleep(0.02)
    return time.perf_counter() - t0


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
                            timeout=900, verify=tls()).json()["usage"]["prompt_tokens"]
        figures = Figures()  # seconds by "short" (its first token) and "busy" (the engine after the client left)
        for i in range(args.tries):
            times: dict = {}
            held: dict = {}
            prompt = f"Try {i}. " + SENTENCE * args.repeat  # a prompt no slot holds
            t = threading.Thread(target=hold, args=(url, prompt, held), daemon=True)
            t.start()
            time.sleep(args.after)
            sent = time.perf_counter()
            first_token(url, "Say hello.", times, "short")
            waited = times["short"] - sent
            figures.add("short", waited)
            while "response" not in held:  # (its headers come before its prefill)
                time.sleep(0.01)
            held["response"].close()  # the long request leaves (its prefill stops at the next chunk)
            t.join()
            wait_idle(url)
            print(f"try {i}: the short request's first token {waited:.2f} s after it was sent", flush=True)
        print(f"\n{tokens}-token prompt prefilling, a short request sent {args.after:.0f} s into it: first token "
              f"median {figures.median('short'):.2f} s, p90 {p90(figures.samples['short']):.2f} s")
        for i in range(args.tries):
            body = {"prompt": f"Leave {i}. " + SENTENCE * args.repeat, "max_tokens": 4, "cache_prompt": False}
            try:
                httpx.post(url + "/v1/completions", json=body, timeout=args.after, verify=tls())
            except httpx.TimeoutException:
                pass  # the client is gone
            figures.add("busy", wait_idle(url))
        print(f"a client that leaves {args.after:.0f} s into the prefill: the engine free "
              f"{figures.median('busy'):.2f} s later (median), p90 {p90(figures.samples['busy']):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
