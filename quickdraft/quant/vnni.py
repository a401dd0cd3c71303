"""quickdraft's own CPU kernels (csrc/vnni.cpp: AVX-512 VNNI), built on first use, and their plain references.

PyTorch's weight-only CPU ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) multiply in floating
point, converting every weight for every row of activations: they stay well below the memory bandwidth for one
row, and their cost grows about linearly with the rows. These kernels quantize the activations (int8, one scale
per row) and multiply bytes by `vpdpbusd`, 64 products per instruction, so one row runs near memory speed and
verifying k+1 rows reads the weights once (the README has the figures).
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

        start = time.perf_counter()
        with _build_lock():
            cpp_extension.load(name=extension_name(), sources=[str(SOURCE)], extra_cflags=FLAGS,
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        if time.perf_counter() - start > 3 and sys.stderr.isatty():  # compiled now, not loaded from the cache
            print(f"built quickdraft's CPU kernels in {time.perf_counter() - start:.0f} s (once per machine)",
                  file=sys.stderr)
    except Exception as e:  # no compiler, no ninja, a build error: fall back, saying why
        lines = str(e).strip().splitlines() or [repr(e)]
        return f"building {SOURCE.name} failed: {next((ln for ln in lines if 'error' in ln), lines[-1]).strip()}"
    return None


def extension_name() -> str:
    """Named by the source's and flags' hash: two versions (two checkouts) never rebuild over each other."""
    return f"quickdraft_vnni_{hashlib.sha1(SOURCE.read_bytes() + ' '.join(FLAGS).encode()).hexdigest()[:10]}"


def build_lock_path() -> Path:
    """The lock held around building and loading the extension, beside PyTorch's own."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(extension_name(), False)) / "quickdraft.lock"


@contextlib.contextmanager
def _build_lock():
    """Hold an OS lock (flock) on build_lock_path: one process builds while the others wait, saying so; a process
    that dies releases it with its descriptor, so nothing is left that makes the next command wait. Holding it, no
    other quickdraft process is in PyTorch's builder, so PyTorch's own `lock` file is nobody's: PyTorch 2.13 waits
    forever on one a killed build left (its lock is a file whose existence blocks), and 2.14 leaves it behind after
    every build or load (there it is an flock too, and a left file is harmless)."""
    path = build_lock_path()
    with open(path, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building quickdraft's CPU kernels (lock {path}; a build takes up to "
                  "a minute)", file=sys.stderr, flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        (path.parent / "lock").unlink(missing_ok=True)
        yield  # released when the file closes, or when the process dies


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
