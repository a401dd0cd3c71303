"""Two clients that keep a server busy, each sending its next request as soon as its last is answered: one asks for
text the draft model predicts (a passage copied out), the other for text it predicts less well (Chinese prose). What
the adaptive policy did for each, by the responses' timings: rounds by source and why (a predicted gain, or a probe),
acceptance, decode speed. The suite runs it for a minute (tests/test_policy_load.py); a longer run is a measurement:

    .venv/bin/python -m tests.policy_load [--seconds 600] [--draft qwen2.5-coder-0.5b] [--json]

The server runs the default target with the draft model alone (no lookup: its rounds are what is measured),
--parallel 2: with two requests always in flight no sequence is ever alone, so every choice is a batch's.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter

from quickdraft.tools.servers import ServerProcess
from tests import loopback

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
           "All that glitters is not gold. Actions speak louder than words. Practice makes perfect. ")
CLIENTS = {
    "predictable": {"messages": [{"role": "user", "content": "Copy this text out exactly, twice, with nothing else:"
                                  "\n\n" + PASSAGE * 2}], "temperature": 0},
    # (not random digits: a draft whose distribution is as flat as the target's is accepted by the exact rule)
    "unpredictable": {"messages": [{"role": "user", "content": "为什么天空是蓝色的？请用一段话详细回答。"}],
                      "temperature": 0},
}


def client(url: str, body: dict, until: float, n: int, out: list) -> None:
    """Requests back to back until `until`: each one's timings."""
    seed = 0
    while time.perf_counter() < until:
        seed += 1
        reply = loopback.post(url + "/v1/chat/completions", json={**body, "max_tokens": n, "seed": seed},
                              timeout=600)
        reply.raise_for_status()
        out.append(reply.json()["timings"])


def summary(timings: list[dict], source: str) -> dict:
    """What one client's requests add up to for a source's rounds (why each was drafted), and the gain the policy
    predicted for the source as its last request ended."""
    rounds, drafted, accepted, reasons, gain = 0, 0, 0, Counter(), None
    for t in timings:
        mine = t["by_source"].get(source, {})
        rounds, drafted, accepted = rounds + mine.get("rounds", 0), drafted + mine.get("drafted", 0), \
            accepted + mine.get("accepted", 0)
        reasons.update(mine.get("reasons", {}))
        gain = mine.get("predicted_gain", gain)
    decode = sorted(t["predicted_per_second"] for t in timings)
    return {"requests": len(timings), "rounds": rounds, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0, "rounds_by_reason": dict(reasons),
            "predicted_gain": gain, "decode_tok_s_median": decode[len(decode) // 2] if decode else 0.0}


def run(seconds: float, draft: str, n: int = 64) -> dict:
    server = ServerProcess("-m", "qwen2.5-coder-1.5b", "--draft", draft, "--parallel", "2", "--ctx", "2048",
                           startup_timeout=600)
    try:
        got = {name: [] for name in CLIENTS}
        until = time.perf_counter() + seconds
        threads = [threading.Thread(target=client, args=(server.url, body, until, n, got[name]))
                   for name, body in CLIENTS.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.stop()
    return {name: summary(timings, "draft") for name, timings in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=64, help="tokens a request")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = run(args.seconds, args.draft, args.n)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"two clients for {args.seconds:.0f} s, the draft model alone (--parallel 2):")
        for name, r in report.items():
            print(f"  {name:13} {r['requests']:3} requests, {r['rounds']:4} draft rounds ({r['rounds_by_reason']}), "
                  f"{100 * r['acceptance']:.0f}% accepted, decode {r['decode_tok_s_median']:.1f} tok/s (median), "
                  f"the policy's predicted gain at the end {r['predicted_gain'] or 0:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
