"""What every benchmark here shares: figures of several configurations measured in turn on a shared, noisy machine
(each run takes every configuration once, the order rotated from run to run), reported as medians with their range and
ratios of medians; and the machine they were measured on, named beside them."""

from __future__ import annotations

import os
import platform
import statistics
from collections import defaultdict


class Figures:
    """Samples by key (any hashable: a configuration, or a (prompt, configuration, figure) tuple)."""

    def __init__(self):
        self.samples: dict = defaultdict(list)

    def add(self, key, value: float | None) -> None:
        if value is not None:
            self.samples[key].append(value)

    def median(self, key) -> float | None:
        values = self.samples.get(key)
        return statistics.median(values) if values else None

    def spread(self, key) -> tuple[float, float] | None:
        values = self.samples.get(key)
        return (min(values), max(values)) if values else None

    def ratio(self, key, reference) -> float | None:
        """The median of key over the median of reference."""
        a, b = self.median(key), self.median(reference)
        return a / b if a is not None and b else None


def rotated(items: list, run: int) -> list:
    """The order of the run-th pass over items: rotated by one each run, so that none always goes first (or last)."""
    if not items:
        return []
    shift = run % len(items)
    return items[shift:] + items[:shift]


def machine() -> str:
    """The machine kind, as figures are labelled: the CPU's model, its cores and the vector extensions that decide
    which kernels run (Linux's /proc/cpuinfo; the platform's name elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name}, {os.cpu_count()} cores" + (f" ({', '.join(shown)})" if shown else "")
