"""quickdraft's own CPU kernels (csrc/vnni.cpp: AVX-512 VNNI), built on first use, and their plain references.

PyTorch's weight-only CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) multiply in floating
point, converting every weight for every row of activations: they stay well below the memory bandwidth for one
row, and their cost grows about linearly with the rows. These kernels quantize the activations (int8, one scale
per row) and multiply bytes by `vpdpbusd`, 64 products per instruction, so one row runs near memory speed and
verifying k+1 rows reads the weights once (docs/performance.md, "quickdraft's CPU kernels", has the figures).
The extension also holds the attention of decode and verification passes (`decode_attention`: each row
alone, batch invariant, in one call instead of one SDPA call per row) and the int4 grid fit (`int4_fit`).

The extension is compiled with the C++ compiler PyTorch's cpp_extension finds (g++), once per machine
into PyTorch's extension cache; where the CPU lacks VNNI or the build fails, `available()` says why and
the layers use PyTorch's ops instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "vnni.cpp"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma", "-ffp-contract=off",
         "-fopenmp"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
QUIET_WAIT_S = 2.0  # a wait for the build lock no longer than this is another process loading: not worth a word


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def _load() -> str | None:
    """None once the ops are registered, else the reason they are not."""
    if os.environ.get("QUICKDRAFT_NO_VNNI"):
        return "QUICKDRAFT_NO_VNNI is set"
    missing = [f for f in CPU_FLAGS if f not in cpu_flags()]
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

        with _build_lock():
            start = time.perf_counter()  # after any wait for the lock: the build's own time
            cpp_extension.load(name=extension_name(), sources=[str(SOURCE)], extra_cflags=FLAGS,
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            took = time.perf_counter() - start
        if took > 3 and sys.stderr.isatty():  # compiled now, not loaded from the cache
            print(f"built quickdraft's CPU kernels in {took:.0f} s (once per machine)", file=sys.stderr)
    except Exception as e:  # no compiler, no ninja, a build error: fall back, saying why
        lines = str(e).strip().splitlines() or [repr(e)]
        return f"building {SOURCE.name} failed: {next((ln for ln in lines if 'error' in ln), lines[-1]).strip()}"
    return None


def extension_name() -> str:
    """Named by the source's and flags' hash: two versions (two checkouts) never rebuild over each other."""
    return f"quickdraft_vnni_{hashlib.sha1(SOURCE.read_bytes() + ' '.join(FLAGS).encode()).hexdigest()[:10]}"


def build_lock_path() -> Path | None:
    """The lock held around building and loading the extension, beside PyTorch's own; None where PyTorch's private
    helper that names that directory is gone or fails (then the kernels load without the lock, as they once did)."""
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(extension_name(), False)) / "quickdraft.lock"
    except Exception:  # noqa: BLE001 - a private function of PyTorch's, which a release may change
        return None


@contextlib.contextmanager
def _build_lock():
    """Hold an OS lock (flock) on build_lock_path: one process builds while the others wait; a process that dies
    releases it with its descriptor, so nothing is left that makes the next command wait. Holding it, no other
    quickdraft process is in PyTorch's builder, so PyTorch's own `lock` file is left over unless a process outside
    quickdraft's lock holds it (_clear_torch_lock)."""
    path = build_lock_path()
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


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


OUTLIER_RATIO = 100.0  # as kOutlierRatio in csrc/vnni.cpp


def _quantize(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = xf.abs().amax(-1) / 127
    q = torch.round(xf / torch.where(d == 0, 1.0, d)[:, None]).clamp(-127, 127)
    return q, d


def quantize_activations(x: torch.Tensor, group: int):
    """The kernels' activation quantization, in plain PyTorch: each row of x (M, K) as int8 codes (round to
    nearest even of x / d, d = max |x| / 127), plus, for a row of massive activations (max |x| above
    OUTLIER_RATIO times its mean |x|), a second level: the remainder x - d q quantized the same way.
    Returns the levels' codes (L, K) int8, scales d (L,), codes' sums per group (L, K / group) and the row
    each level belongs to (L,)."""
    xf = x.float()
    q, d = _quantize(xf)
    outlier = xf.abs().amax(-1) > OUTLIER_RATIO * xf.abs().mean(-1)
    rows = torch.arange(x.shape[0])
    if outlier.any():
        q2, d2 = _quantize((xf - d[:, None] * q)[outlier])
        q, d, rows = torch.cat([q, q2]), torch.cat([d, d2]), torch.cat([rows, rows[outlier]])
    return q.to(torch.int8), d, q.reshape(q.shape[0], -1, group).sum(-1).to(torch.int32), rows


def _combine(x, q, d, rows, w, bias) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[0]).index_add_(0, rows, (q.float() @ w.t()) * d[:, None])
    return (out + bias.float() if bias is not None else out).to(torch.bfloat16)


def int8_reference(x, u, scales, bias) -> torch.Tensor:
    """What `int8_linear` computes, in float: u (N, K) uint8 holds q + 128."""
    q, d, _, rows = quantize_activations(x, x.shape[-1])
    return _combine(x, q, d, rows, (u.to(torch.int32) - 128).float() * scales[:, None], bias)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K / 2) uint8: in each chunk of 128 (4 groups of 32), byte 16g + i holds
    elements 32g + i (low nibble) and 32g + 16 + i (high nibble): a byte's two codes share a group."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 128, 4, 2, 16)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    p = packed.reshape(n, half // 64, 4, 16)
    return torch.stack([p & 15, p >> 4], dim=3).reshape(n, half * 2)


def int4_reference(x, packed, scales, lows, bias) -> torch.Tensor:
    """What `int4_linear` computes, in float: w = code * scale + low per group of 32."""
    q, d, _, rows = quantize_activations(x, 32)
    n = packed.shape[0]
    codes = unpack_int4(packed).float().reshape(n, -1, 32)
    w = (codes * scales.float()[..., None] + lows.float()[..., None]).reshape(n, -1)
    return _combine(x, q, d, rows, w, bias)


TILE = 4  # output rows the kernels read together: their weights interleave into one sequential stream


def tile(t: torch.Tensor, piece: int) -> torch.Tensor:
    """(N, L) -> the same shape with each tile of 4 rows interleaved in pieces of `piece` elements."""
    n, length = t.shape
    return t.reshape(n // TILE, TILE, length // piece, piece).transpose(1, 2).contiguous().reshape(n, length)


def untile(t: torch.Tensor, piece: int) -> torch.Tensor:
    n, length = t.shape
    return t.reshape(n // TILE, length // piece, TILE, piece).transpose(1, 2).contiguous().reshape(n, length)
