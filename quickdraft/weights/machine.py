"""This machine as quickdraft's CPU kernels see it: what an int4 and an int8 weight cost here (quant/calibrate.py,
measured once in a few seconds and kept per machine: its CPU's model and flags, PyTorch's version, the kernels'
build), and what that chooses by default: a 4-bit GGUF target's runtime format and the threads.

`mixed` (int4 where the file holds 4-bit blocks, int8 where it holds more bits) keeps the file's quality closest; `int4`
reads fewer bytes. Which decodes faster depends on the machine (on the AMD EPYC Zen 4 and Intel Xeon VMs met so far,
int4; see docs/performance.md): the target is given int4 where the figures predict it more than MARGIN faster over a
decoding step and a verification, else mixed. A float checkpoint stays in mixed (int8 throughout): int4 would lose
what no file's blocks bound.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from quickdraft.quant import calibrate, vnni
from quickdraft.quant.calibrate import ROWS

VERSION = 2
MARGIN = 0.10  # int4 must be predicted this much faster than mixed, whose quality is the file's own (KL from bf16 0.011
#                against int4's 0.028 on the default target: docs/performance.md)
TOKENS_PER_ROUND = 2.5  # a verification of 5 rows emits about this many tokens (what its cost is shared by)


def key() -> str:
    """The machine's name for its figures: the CPU's model and flags, PyTorch's version, the kernels' build."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    text = " ".join([model, *sorted(vnni.cpu_flags()), torch.__version__, vnni.extension_name(), str(VERSION)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def figures(cache_dir: Path, say=None) -> dict | None:
    """The figures of this machine, measured now if they are not kept yet (say(line) is told so); None where
    quickdraft's CPU kernels do not run here."""
    if not vnni.available():
        return None
    path = cache_dir / "machine" / f"{key()}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if say is not None:
        say("measuring this machine's kernels once (a few seconds; kept for the next runs)")
    t0 = time.perf_counter()
    counts = calibrate.thread_counts()
    runs = {n: calibrate.measure(n) for n in counts}
    threads = min(counts, key=lambda n: runs[n]["int4"][1])
    found = {"threads": threads, "seconds_per_weight": {kind: {str(r): v for r, v in by_rows.items()}
                                                        for kind, by_rows in runs[threads].items()},
             "measured": time.strftime("%Y-%m-%d %H:%M"), "took_s": round(time.perf_counter() - t0, 1),
             "threads_tried": {str(n): runs[n]["int4"][1] for n in counts}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=1))
    return found


def step_seconds(counts: dict[str, int], found: dict) -> float:
    """A decoding step's share of the weights' time, per token: one row, plus a verification of ROWS[-1] rows shared
    by the tokens it emits (the same weight in both: what speculation runs)."""
    per = found["seconds_per_weight"]
    total = 0.0
    for kind, n in counts.items():
        if kind in per:
            total += n * (per[kind][str(ROWS[0])] + per[kind][str(ROWS[-1])] / TOKENS_PER_ROUND)
    return total


def target_format(counts: dict[str, dict[str, int]], found: dict) -> tuple[str, str]:
    """(int4 or mixed, why) for a target whose linear weights take counts[fmt] of each kind in each format."""
    mixed, int4 = step_seconds(counts["mixed"], found), step_seconds(counts["int4"], found)
    why = (f"a step's weights take {1000 * int4:.1f} ms in int4, {1000 * mixed:.1f} ms in mixed on this machine "
           f"(measured {found['measured']})")
    return ("int4" if int4 < (1 - MARGIN) * mixed else "mixed"), why


def say_on_stderr(line: str) -> None:
    print(f"quickdraft: {line}", file=sys.stderr)
