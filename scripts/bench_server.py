"""Through the HTTP server, side by side in one run: speculation off vs on, per prompt, greedy.

Starts `quickdraft serve` on the default pair, then for each prompt alternates requests with
{"speculative": {"draft_max": 0}} and with the server's default speculation, and prints the median decode
tok/s the responses' timings report, the ratio, the acceptance and whether the texts are identical.
Run: .venv/bin/python scripts/bench_server.py [--runs 3] [-n 128]
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import httpx

from quickdraft.tools.remote import tls
from quickdraft.tools.servers import ServerProcess
from quickdraft.tools.runs import Figures, machine, rotated

PROMPTS = {
    "code": "Write a Python function that checks whether a string is a palindrome, with a short docstring.",
    "summary": "Summarize in three sentences: The Industrial Revolution began in Britain in the late 18th "
               "century, when new machines for spinning and weaving moved textile work from homes into "
               "factories, steam engines powered mines and mills, and railways cut the cost of moving goods.",
    "chinese": "用三句话介绍一下长城的历史。",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("serve_args", nargs="*", help="extra arguments for `quickdraft serve` (after --)")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    print(f"{'prompt':8} {'config':12} {'tok/s (median)':>14} {'x off':>6} {'accept':>7} {'tok/round':>9} "
          f"{'same text':>9}")
    with ServerProcess(*args.serve_args) as server:
        url = server.base_url + "/chat/completions"
        figures = Figures()  # by (prompt, "off" or "on", "tok/s" or "tok/round")
        for name, prompt in PROMPTS.items():
            results = {"off": [], "on": []}
            for run in range(args.runs + 1):  # the first pass of each prompt is a warm-up
                for config, spec in rotated([("off", {"draft_max": 0}), ("on", None)], run):
                    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                            "temperature": 0, **({"speculative": spec} if spec else {})}
                    r = httpx.post(url, json=body, timeout=600, verify=tls()).json()
                    if run:
                        results[config].append((r["timings"], r["choices"][0]["message"]["content"]))
                        figures.add((name, config, "tok/s"), r["timings"]["predicted_per_second"])
                        figures.add((name, config, "tok/round"), r["timings"]["mean_accepted_length"])
            texts = {hashlib.sha256(t.encode()).hexdigest() for rows in results.values() for _, t in rows}
            for config, rows in results.items():
                drafted = sum(t["draft_n"] for t, _ in rows)
                accept = sum(t["draft_n_accepted"] for t, _ in rows) / drafted if drafted else 0.0
                print(f"{name:8} {('spec ' + config):12} {figures.median((name, config, 'tok/s')):14.2f} "
                      f"{figures.ratio((name, config, 'tok/s'), (name, 'off', 'tok/s')):6.2f} {accept:7.0%} "
                      f"{figures.median((name, config, 'tok/round')):9.2f} {'yes' if len(texts) == 1 else 'NO':>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
