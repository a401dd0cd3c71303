#!/usr/bin/env python
"""gpu_check.sh's first phase: in seconds, what the run will meet, and whether it can run at all.

Prints the versions (Python, torch, CUDA, cuDNN, Triton, transformers, gguf, llguidance, dflash, pytest), the
driver, the GPU, the CPU's flags, the C compiler, the attention backends quickdraft enables and which of them takes
each kind of pass, the Triton int8 kernel's first launch (on the CPU: under its interpreter), the reference files
carried; imports every module the tests and the benchmark import (read from their source, function-level imports
included), and looks up every transformers class the tests build models with.

Exit 2 only where every later phase would be meaningless: torch, quickdraft or pytest (with pytest-timeout) cannot be
imported, or no CUDA device is seen. Anything else missing is named, with what to carry, and exits 1: the run goes
on, and the tests that need it fail saying so.

Usage: python scripts/gpu_preflight.py [--device cuda|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Without these no later phase means anything: the run stops
ESSENTIAL = ("torch", "pytest", "pytest_timeout", "quickdraft.api", "quickdraft.engine")
# The run's own code, whose imports (module level and inside functions) the preflight makes
SOURCES = ("tests/test_cuda.py", "scripts/gpu_bench.py")
# The tests' model builders: the transformers classes named there must exist in the image's transformers
BUILDERS = ("tests/helpers.py", "tests/families.py", "tests/test_hybrid.py", "tests/test_moe.py",
            "tests/test_assistant.py", "tests/test_dflash.py", "tests/test_hybrid_gguf.py")
VERSIONS = ("torch", "triton", "transformers", "gguf", "llguidance", "dflash", "tokenizers", "safetensors", "numpy",
            "pytest", "pytest-timeout")
CARRIED = {"gguf", "llguidance", "dflash"}  # not on the GPU image: scripts/gpu_prepare.sh puts their wheels in .gpu/whl
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", help="write what was found here too")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    start = time.perf_counter()
    found = Found(args.json)
    found.add({"python": platform.python_version(), "device_asked": args.device} | _machine())
    absent: dict[str, list[str]] = {}  # a missing package -> the modules that could not import for it
    for name in ESSENTIAL + tuple(m for m in modules_used() if m not in ESSENTIAL):
        problem, package = _import(name)
        if package and name not in ESSENTIAL:
            absent.setdefault(package, []).append(name)
        elif problem:
            found.problem(name in ESSENTIAL, problem)
    for package, names in absent.items():
        found.problem(False, _missing(package, names))
    found.add({name: _version(name) for name in VERSIONS})
    if "transformers" in sys.modules:
        for c in transformers_classes():
            if not hasattr(sys.modules["transformers"], c):
                found.problem(False, f"transformers {found.items['transformers']} has no {c}: the tests that build "
                                     "it fail")
    found.add({"references": sorted(p.name for p in (ROOT / ".gpu" / "ref").glob("*.gguf"))})
    if "torch" in sys.modules and "quickdraft.api" in sys.modules:
        _device(args.device, found)
    found.add({"seconds": round(time.perf_counter() - start, 1)})
    return 2 if found.fatal else 1 if found.missing else 0


class Found:
    """What the preflight found, printed as it is found and written to the JSON file each time (a preflight killed
    at its limit still leaves what it had)."""

    def __init__(self, path: str | None):
        self.path, self.items, self.fatal, self.missing = path, {}, [], []

    def add(self, items: dict) -> None:
        for key, value in items.items():
            print(f"preflight: {key}: {value}", flush=True)
        self.items |= items
        self.save()

    def problem(self, fatal: bool, line: str) -> None:
        print(f"preflight: {'FATAL' if fatal else 'MISSING'} {line}", flush=True)
        (self.fatal if fatal else self.missing).append(line)
        self.save()

    def save(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps({**self.items, "fatal": self.fatal, "missing": self.missing},
                                                  indent=1, default=str), encoding="utf-8")


def modules_used() -> list[str]:
    """Every module SOURCES import, in their order: a broken one is named here, not in the middle of a phase."""
    names: list[str] = []
    for source in SOURCES:
        for node in ast.walk(ast.parse((ROOT / source).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module)
                # `from tests import llamacpp`: the names may be modules themselves
                names += [f"{node.module}.{a.name}" for a in node.names if node.module in ("tests", "quickdraft")]
    return list(dict.fromkeys(n for n in names if n != "__future__"))


def transformers_classes() -> list[str]:
    pattern = re.compile(r"\btransformers\.([A-Z]\w+)")
    return sorted({m for f in BUILDERS for m in pattern.findall((ROOT / f).read_text(encoding="utf-8"))})


def _import(name: str) -> tuple[str | None, str | None]:
    """(what failed, the missing package it failed for), both None where name imports."""
    try:
        importlib.import_module(name)
    except ImportError as raised:  # a module's own ImportError may say why, a missing package its cause
        e = raised if isinstance(raised, ModuleNotFoundError) else raised.__cause__
        if not isinstance(e, ModuleNotFoundError):
            return f"cannot import {name} ({raised})", None
        package = e.name.split(".")[0] if e.name else None
        parent, _, leaf = name.rpartition(".")
        if package == name.split(".")[0] and parent in sys.modules and hasattr(sys.modules[parent], leaf):
            return None, None  # `from tests import helpers`-style names that are attributes, not modules
        if package in ("tests", "quickdraft", None):
            return f"cannot import {name} ({e}): a file of the working tree is missing", None
        return _missing(package, [name]), package
    except Exception as e:  # noqa: BLE001: any failure to import is what this phase reports
        return f"cannot import {name} ({type(e).__name__}: {str(e)[:300]}): a file of the working tree or a " \
               "package of the image is broken", None
    return None, None


def _missing(package: str, names: list[str]) -> str:
    fix = ("carry its wheel: run scripts/gpu_prepare.sh here and name .gpu in carry" if package in CARRIED else
           "add its wheel to scripts/gpu_prepare.sh")
    needed = [n for n in names if n != package]
    return f"{package} is missing{' (needed by ' + ', '.join(needed) + ')' if needed else ''}: {fix}"


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "absent"


def _machine() -> dict:
    """The host: CPU model and the flags quickdraft's kernels care about, the C compiler (Triton's launcher and any
    extension need one), the NVIDIA driver."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = cpuinfo.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1] for ln in lines if ln.startswith("flags")), "").split())
    out = {"cpu": f"{model}, {os.cpu_count()} cores", "cpu_flags": " ".join(f for f in CPU_FLAGS if f in flags)}
    cc = shutil.which("cc") or shutil.which("gcc")
    out["compiler"] = _first_line([cc, "--version"]) if cc else "none (Triton cannot build its launcher)"
    if shutil.which("nvidia-smi"):
        out["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                                     "--format=csv,noheader"])
    return out


def _first_line(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return (done.stdout or done.stderr).strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001
        return f"failed ({type(e).__name__})"


def _device(device: str, found: Found) -> None:
    import torch

    found.add({"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
               "torch_threads": torch.get_num_threads(),
               "cpu_kernels": "off (QUICKDRAFT_NO_VNNI)" if os.environ.get("QUICKDRAFT_NO_VNNI") else "on"})
    if device == "cpu":
        _triton_launch(found, interpret=True)
        return
    if not torch.cuda.is_available():
        found.problem(True, "PyTorch sees no CUDA device: run on the GPU machine, or rehearse with --device cpu")
        return
    props = torch.cuda.get_device_properties(0)
    found.add({"gpu": props.name, "capability": f"{props.major}.{props.minor}",
               "memory_gib": props.total_memory / 2**30, "sms": props.multi_processor_count,
               "cudnn": torch.backends.cudnn.version()})
    from quickdraft.runtime.plan import attention_backends

    found.add({"attention": attention_backends()})
    _triton_launch(found, interpret=False)  # before the probe: what a failed compile says matters more
    found.add(_attention_probe(torch))


def _triton_launch(found: Found, interpret: bool) -> None:
    """The int8 kernel's first launch, timed: on the GPU what `doctor` reports (PyTorch's kernel runs where it
    fails); on the CPU under Triton's interpreter, as CI tests it (in a process of its own: Triton reads the switch
    when it is imported)."""
    from quickdraft.quant import gpu

    t0 = time.perf_counter()
    reason = _interpreted_launch() if interpret else gpu.triton_reason()
    took = round(time.perf_counter() - t0, 2)
    if reason and interpret:  # the interpreter is CI's, not the GPU's (Triton 3.6's fails on numpy 2.4): a note
        reason += " (the interpreter only: on a GPU Triton compiles it)"
    elif reason:
        found.problem(False, f"the Triton int8 kernel: {reason}")
    found.add({"triton_int8": reason or "runs", "triton_first_launch_s": took})


INTERPRETED = """
import torch
from quickdraft.quant import gpu
x, q = torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.int8)
assert torch.equal(gpu.int8_mm(x, q, torch.ones(64), None, 1).float(), torch.full((2, 64), 64.0)), "a wrong result"
"""


def _interpreted_launch() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    try:
        done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        return "its interpreted launch took over 120 s"
    lines = done.stderr.strip().splitlines()
    return None if done.returncode == 0 else f"its interpreted launch failed ({lines[-1][:300] if lines else '?'})"


def _attention_probe(torch) -> dict:
    """Which enabled backend takes each kind of pass, in the shapes the models use (grouped-query heads, head
    dimensions 16 to 256): a step without a mask, and a graphed pass with a mask over the cache. A backend that
    cannot take a pass raises when it is the only one allowed."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for dim in (16, 64, 128, 256):
        q = torch.randn(1, 12, 16, dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, 2, 256, dim, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(16, 256, dtype=torch.bool, device="cuda").tril(240)
        for kind, m, rows in (("step", None, 1), ("graphed", mask, 16)):
            takers = []
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
                try:
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q[:, :, :rows], kv, kv, attn_mask=m, enable_gqa=True)
                    takers.append(backend.name)
                except RuntimeError:
                    pass
            out[f"attention_{kind}_d{dim}"] = takers[0] if takers else "none of the enabled backends"
    torch.cuda.synchronize()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
