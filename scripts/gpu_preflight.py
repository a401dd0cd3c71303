#!/usr/bin/env python
"""gpu_check.sh's first phase: in seconds, what the run will meet, and whether it can run at all.

Prints the versions (Python, torch, CUDA, cuDNN, Triton, transformers, gguf, llguidance, pytest), the device, the
attention backends quickdraft enables and which of them takes each kind of pass, the Triton int8 kernel's first
launch, the reference files carried; imports every module the run needs. Exit 2 with one line per missing piece
(and what to carry) when something the run needs is absent, so the run stops before the GPU time is spent.

Usage: python scripts/gpu_preflight.py [--device cuda|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every module the run imports (the tests, the benchmark, what they load). gguf and llguidance are not on the GPU
# image: scripts/gpu_prepare.sh fetches their wheels into .gpu/whl.
MODULES = ("torch", "numpy", "gguf", "llguidance", "tokenizers", "safetensors", "jinja2", "rich", "transformers",
           "pytest", "pytest_timeout", "quickdraft.api", "quickdraft.engine", "quickdraft.tools.roofline",
           "quickdraft.weights.memory", "quickdraft.speculative.mtp", "quickdraft.speculative.assistant",
           "tests.helpers", "tests.families", "tests.test_hybrid", "tests.test_moe", "tests.test_assistant",
           "tests.llamacpp")
VERSIONS = ("torch", "triton", "transformers", "gguf", "llguidance", "tokenizers", "numpy", "pytest")
CARRIED = {"gguf": "gguf", "llguidance": "llguidance", "pytest_timeout": "pytest-timeout"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", help="write what was found here too")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    found = {"python": platform.python_version(), "device_asked": args.device}
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001: any failure to import is what this phase reports
            wheel = CARRIED.get(name.split(".")[0])
            fix = "carry its wheel: run scripts/gpu_prepare.sh here and name .gpu in carry" if wheel else \
                "a file of the working tree or a package of the image is broken"
            missing.append(f"cannot import {name} ({type(e).__name__}: {e}): {fix}")
    for name in VERSIONS:
        found[name] = _version(name)
    if "torch" in sys.modules:
        found |= _device(args.device, missing)
    found["references"] = sorted(p.name for p in (ROOT / ".gpu" / "ref").glob("*.gguf"))
    for key, value in found.items():
        print(f"preflight: {key}: {value}")
    for line in missing:
        print(f"preflight: MISSING {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({**found, "missing": missing}, indent=1, default=str), encoding="utf-8")
    return 2 if missing else 0


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "absent"


def _device(device: str, missing: list[str]) -> dict:
    import torch

    out = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if device == "cpu":
        from quickdraft.quant import vnni

        out["cpu_kernels"] = vnni.available()
        return out
    if not torch.cuda.is_available():
        missing.append("PyTorch sees no CUDA device: run on the GPU machine, or rehearse with --device cpu")
        return out
    props = torch.cuda.get_device_properties(0)
    out |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 2**30,
            "cudnn": torch.backends.cudnn.version()}
    from quickdraft.quant import gpu
    from quickdraft.runtime.plan import attention_backends

    out["triton_int8"] = gpu.triton_reason() or "runs"
    out["attention"] = attention_backends()
    out |= _attention_probe(torch)
    return out


def _attention_probe(torch) -> dict:
    """Which enabled backend takes each kind of pass, in the shapes the models use (grouped-query heads): a step
    without a mask, and a graphed pass with a mask over the cache. A backend that cannot take a pass raises when
    it is the only one allowed."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 12, 16, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(16, 256, dtype=torch.bool, device="cuda").tril(240)
    out = {}
    for kind, m, rows in (("step", None, 1), ("graphed", mask, 16)):
        takers = []
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q[:, :, :rows], kv, kv, attn_mask=m, enable_gqa=True)
                takers.append(backend.name)
            except RuntimeError:
                pass
        out[f"attention_{kind}"] = takers[0] if takers else "none of the enabled backends"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
