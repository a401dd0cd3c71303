"""Building and loading one of quickdraft's C++ kernel extensions (quant/csrc): compiled with the C++ compiler
PyTorch's cpp_extension finds (g++), once per machine into PyTorch's extension cache, under a lock so that two
processes never build over each other; where the CPU lacks the instructions or the build fails, `reason()` says why
and the layers use PyTorch's ops instead."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import time
from pathlib import Path

QUIET_WAIT_S = 2.0  # a wait for the build lock no longer than this is another process loading: not worth a word


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


class Extension:
    """One source file's extension: its name's prefix (also its operators' namespace), the compiler flags, the CPU
    flags it needs, the environment variable that turns it off, and the headers it includes."""

    def __init__(self, prefix: str, source: Path, flags: list[str], needs: tuple[str, ...], off: str,
                 headers: tuple[Path, ...] = ()):
        self.prefix, self.source, self.flags, self.needs, self.off = prefix, source, flags, needs, off
        self.headers = headers  # files the source includes: part of what names the build

    def name(self) -> str:
        """Named by the source's, headers' and flags' hash: two versions (two checkouts) never rebuild over each
        other."""
        text = b"".join(p.read_bytes() for p in (self.source, *self.headers)) + " ".join(self.flags).encode()
        digest = hashlib.sha1(text).hexdigest()
        return f"{self.prefix}_{digest[:10]}"

    @functools.cache  # noqa: B019 - one per extension, for the process's life
    def reason(self) -> str | None:
        """None once the ops are registered, else the reason they are not."""
        if os.environ.get(self.off):
            return f"{self.off} is set"
        missing = [f for f in self.needs if f not in cpu_flags()]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        bin_dir = str(Path(sys.executable).parent)  # the venv's ninja, when the venv is not activated
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
        try:
            import logging

            # its import warns "No CUDA runtime is found, using CUDA_HOME=..." wherever a CUDA toolkit sits without a
            # GPU: irrelevant to a CPU extension, and not the user's concern
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            from torch.utils import cpp_extension

            with self.lock():
                start = time.perf_counter()  # after any wait for the lock: the build's own time
                cpp_extension.load(name=self.name(), sources=[str(self.source)], extra_cflags=self.flags,
                                   extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
                took = time.perf_counter() - start
            if took > 3 and sys.stderr.isatty():  # compiled now, not loaded from the cache
                print(f"built quickdraft's CPU kernels ({self.source.name}) in {took:.0f} s (once per machine)",
                      file=sys.stderr)
        except Exception as e:  # no compiler, no ninja, a build error: fall back, saying why
            lines = str(e).strip().splitlines() or [repr(e)]
            said = next((ln for ln in lines if "error" in ln), lines[-1]).strip()
            return f"building {self.source.name} failed: {said}"
        return None

    def lock_path(self) -> Path | None:
        """The lock held around building and loading the extension, beside PyTorch's own; None where PyTorch's
        private helper that names that directory is gone or fails (then the kernels load without the lock, as they
        once did)."""
        from torch.utils import cpp_extension

        try:
            return Path(cpp_extension._get_build_directory(self.name(), False)) / "quickdraft.lock"
        except Exception:  # noqa: BLE001 - a private function of PyTorch's, which a release may change
            return None

    @contextlib.contextmanager
    def lock(self):
        """Hold an OS lock (flock) on lock_path: one process builds while the others wait; a process that dies
        releases it with its descriptor, so nothing is left that makes the next command wait. Holding it, no other
        quickdraft process is in PyTorch's builder, so PyTorch's own `lock` file is left over unless a process outside
        quickdraft's lock holds it (_clear_torch_lock)."""
        path = self.lock_path()
        try:
            held = open(path, "a") if path is not None else None
        except OSError:  # a directory we cannot write: PyTorch's builder will say so
            held = None
        if held is None:
            yield
            return
        with held:
            _acquire(held, path)
            _clear_torch_lock(path.parent / "lock")
            yield  # released when the file closes, or when the process dies


def _acquire(held, path: Path) -> None:
    """Take the lock, saying so on stderr (whether or not it is a terminal) once the wait is longer than a load:
    the lock is held for every load too (about a second), and two commands started together wait that long for
    each other with nothing being built."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    print(f"waiting for another process building quickdraft's CPU kernels (lock {path}; a build takes up to a "
          "minute)", file=sys.stderr, flush=True)
    fcntl.flock(held, fcntl.LOCK_EX)


def _clear_torch_lock(lock: Path) -> None:
    """Remove PyTorch's `lock` file unless a live process holds it. PyTorch 2.13's lock is a file whose existence
    blocks: one a killed build left makes every later load wait forever. 2.14's is an flock and its file is left
    after every build or load (harmless); one held now is a build outside quickdraft's lock (an older quickdraft
    checkout, sharing the extension's name), left alone. An older checkout building under 2.13 right now would lose
    its lock file: nothing tells it from one a killed build left."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:  # none, or not ours to touch
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.unlink(missing_ok=True)
    except OSError:  # held by a live process
        pass
    finally:
        os.close(fd)
