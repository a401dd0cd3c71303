"""Wall time of device work, the device synced around it: what the policy's probes, the drafters' self-description
and the tools' measurements time with."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run, device: torch.device, reps: int, before=None) -> float:
    """Median wall time of run() over reps calls after one warm-up call (one-off setup), the device synced
    around each; before() (e.g. a cache rollback) runs untimed ahead of every call."""
    times = [timed(run, device, before) for _ in range(reps + 1)]
    return statistics.median(times[1:])


def timed(run, device: torch.device, before=None) -> float:
    """Wall time of one run() (before() first, untimed), the device synced around it."""
    if before is not None:
        before()
    sync(device)
    t0 = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - t0
