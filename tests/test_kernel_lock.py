"""The CPU kernels' build lock (quant/vnni.py): a lock that dies with its process. A built extension loads without
waiting, whatever lock file an earlier run left (PyTorch 2.14's builder leaves its `lock` file after every run; a
killed 2.13 build leaves one too), and a build running in another process is waited for, saying so."""

import fcntl
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from quickdraft.quant import vnni

pytestmark = pytest.mark.skipif(any(f not in vnni.cpu_flags() for f in vnni.CPU_FLAGS),
                                reason="this CPU cannot run the VNNI kernels")
LOAD = ("import time; t = time.perf_counter(); from quickdraft.quant import vnni; r = vnni.unavailable_reason(); "
        "print(f'{time.perf_counter() - t:.2f}', r)")


def load_in_a_process(**kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def loaded(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[float, str]:
    """(seconds the load took in the child, its stderr); fails unless the kernels loaded."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-2000:]
    seconds, reason = out.split(maxsplit=1)
    assert reason.strip() == "None", out + err[-2000:]
    return float(seconds), err


def build_directory() -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(vnni.extension_name(), False))


def test_a_built_extension_loads_in_a_second_process_past_a_left_lock_file():
    first_s, _ = loaded(load_in_a_process())  # builds once per machine (or finds it built)
    left = build_directory() / "lock"
    left.touch()  # what PyTorch 2.14 leaves after every run, and a killed 2.13 build leaves behind
    proc = load_in_a_process()
    try:
        second_s, err = loaded(proc, timeout_s=120)  # the old code waited STALE_LOCK_S = 180 s here
    finally:
        proc.kill()
    print(f"\nkernels loaded in a first process in {first_s:.2f} s, in a second one past a left lock file in "
          f"{second_s:.2f} s")
    assert "waiting" not in err, err


def test_a_build_in_another_process_is_waited_for_saying_so():
    loaded(load_in_a_process())
    with open(vnni.build_lock_path(), "a") as held:  # as a process building the kernels holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = load_in_a_process()
        lines = queue.Queue()  # the child's stderr, read on a thread (a pipe's buffered reader and select disagree)
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr] + [lines.put("")], daemon=True).start()
        said = ""
        while "waiting for another process" not in said:  # the child, waiting for the lock, says so
            try:
                said = lines.get(timeout=120)
            except queue.Empty:
                said = ""
            if not said:  # silent for 2 minutes, or gone
                proc.kill()
                pytest.fail("the load neither said it waits nor went on")
        assert proc.poll() is None
    # released: the waiting process goes on
    assert proc.wait(timeout=300) == 0
    seconds, reason = proc.stdout.read().split(maxsplit=1)
    assert reason.strip() == "None"
    print(f"\nwaited for another build, then loaded ({float(seconds):.2f} s in all); it said: {said.strip()}")


def test_without_pytorchs_private_helper_the_kernels_load_without_the_lock(monkeypatch):
    """The lock's directory comes from a private function of PyTorch's: where a release drops it, no lock, and
    the load goes on as it did before there was one."""
    from torch.utils import cpp_extension

    monkeypatch.delattr(cpp_extension, "_get_build_directory")
    assert vnni.build_lock_path() is None
    with vnni._build_lock():
        pass
