"""This machine as quickdraft's CPU kernels see it: what an int4 and an int8 weight cost here (quant/calibrate.py,
measured once in a few seconds and kept per machine: its CPU's model and flags, the CPUs this process may use,
PyTorch's version, the kernels' build; `quickdraft doctor --measure` measures again), and what that chooses by
default: a 4-bit GGUF target's runtime format and the threads, and the prices the speculation policy starts from
(weight_seconds: api.prior).

`mixed` (int4 where the file holds 4-bit blocks, int8 where it holds more bits) keeps the file's quality closest; `int4`
reads fewer bytes. Which decodes faster depends on the machine (on the AMD EPYC Zen 4 and Intel Xeon VMs met so far,
int4; see docs/performance.md): the target is given int4 where the figures predict it more than MARGIN faster over a
decoding step and a verification, else mixed. A float checkpoint stays in mixed (int8 throughout): int4 would lose
what no file's blocks bound.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from quickdraft.quant import calibrate, vnni
from quickdraft.quant.calibrate import ROWS

VERSION = 3  # (3: medians with a noise guard, keyed by the usable CPUs)
MARGIN = 0.10  # int4 must be predicted this much faster than mixed, whose quality is the file's own (KL from bf16 0.011
#                against int4's 0.028 on the default target: docs/performance.md)
TOKENS_PER_ROUND = 2.5  # a verification of 5 rows emits about this many tokens (what its cost is shared by)


def key() -> str:
    """The machine's name for its figures: the CPU's model and flags, the CPUs this process may use (a container or a
    VM with fewer cores runs other thread counts at other speeds), PyTorch's version, the kernels' build."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    text = " ".join([model, *sorted(vnni.cpu_flags()), f"cpus={calibrate.usable_cpus()}", torch.__version__,
                     vnni.extension_name(), str(VERSION)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


_MEASURED: dict = {}  # key -> figures measured by this process where they could not be kept


def figures(cache_dir: Path, say=None, again: bool = False) -> dict | None:
    """The figures of this machine, measured now if they are not kept yet (say(line) is told so) or `again`; None
    where quickdraft's CPU kernels do not run here. A cache directory that cannot be written only costs the next
    process a measurement (said)."""
    if not vnni.available():
        return None
    name = key()
    path = cache_dir / "machine" / f"{name}.json"
    if not again:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            if name in _MEASURED:
                return _MEASURED[name]
    if say is not None:
        say("measuring this machine's kernels " + ("again" if again else "once (a few seconds; kept for the next runs)"))
    found = _MEASURED[name] = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(found, indent=1))
    except OSError as e:
        if say is not None:
            say(f"cannot keep them in {path.parent} ({e.strerror or e}): each run measures them again")
    return found


def measure() -> dict:
    """The figures, measured now: the thread count that runs int4 fastest, and each kind's seconds per weight with it
    (calibrate.measure: medians, measured again where busy; `spread` says how much its passes varied)."""
    t0 = time.perf_counter()
    counts = calibrate.thread_counts()
    runs = {n: calibrate.measure(n) for n in counts}
    threads = min(counts, key=lambda n: runs[n]["int4"][1])
    kinds = {kind: by_rows for kind, by_rows in runs[threads].items() if kind != "spread"}
    return {"threads": threads, "seconds_per_weight": {kind: {str(r): v for r, v in by_rows.items()}
                                                       for kind, by_rows in kinds.items()},
            "spread": round(runs[threads]["spread"], 3), "measured": time.strftime("%Y-%m-%d %H:%M"),
            "took_s": round(time.perf_counter() - t0, 1), "threads_tried": {str(n): runs[n]["int4"][1] for n in counts}}


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


def weight_seconds(model, found: dict):
    """What a pass of r rows over the model's linear layers (a tied head's included) takes on this machine's kernels,
    by their measured seconds per weight (linear in the rows between and beyond the rows measured): a function of r,
    or None where a twentieth or more of its weights run elsewhere (PyTorch's bf16 kernels, CUDA: not measured)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kind = getattr(module, "format", None)
        if kind in ("int4", "int8") and getattr(module, "vnni", False):
            counts[kind] = counts.get(kind, 0) + module.out_features * module.in_features
        elif isinstance(module, torch.nn.Linear):
            counts["other"] = counts.get("other", 0) + module.weight.numel()
    if not counts or counts.get("other", 0) >= sum(counts.values()) / 20:
        return None
    per = found["seconds_per_weight"]
    (r0, r1) = ROWS

    @functools.lru_cache(maxsize=512)  # (the policy asks for the same few row counts at every step)
    def seconds(rows: int) -> float:
        return sum(n * (per[kind][str(r0)] + (per[kind][str(r1)] - per[kind][str(r0)]) * (rows - r0) / (r1 - r0))
                   for kind, n in counts.items() if kind in per)
    return seconds


def say_on_stderr(line: str) -> None:
    print(f"quickdraft: {line}", file=sys.stderr)
