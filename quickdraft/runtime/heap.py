"""Memory a finished request freed goes back to the system (Linux, glibc).

glibc's malloc serves a large block by mapping it and gives it back when freed, but each time such a block is freed
it raises its threshold for mapping to that block's size (up to 32 MiB): from then on blocks of that size come from
its heap, whose freed memory it keeps. A server's passes allocate and free activations of every size as prompts of
every length come and go, so its resident memory grows past what it holds (kept conversations, bounded by
--cache-ram) and never shrinks. Trimming the heap when a request ends gives that memory back; passes keep reusing the
heap while they run (fixing the threshold instead cost prefill 11%: every chunk's activations mapped afresh).
Measured with scripts/bench_parallel.py --cycling 32 --cache-ram 256M (default pair, Intel Xeon, 2 cores): see
docs/server.md.
"""

from __future__ import annotations

import ctypes
import sys

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL("libc.so.6")
                libc.malloc_trim  # (glibc's: musl has none)
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc


def trim() -> bool:
    """Give the heap's free memory back to the system; whether any was."""
    libc = _c()
    return bool(libc.malloc_trim(0)) if libc else False
