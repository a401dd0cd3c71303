#!/usr/bin/env python
"""Two versions of quickdraft's CPU kernels (csrc/kernels.cpp with csrc/simd.h) side by side in one process: the
working tree's and a git revision's (or the same source built for two instruction sets: `--base-isa`), each built
under an operator namespace of its own, their int4 and int8 linear layers called in turn on the same weights, rep
after rep. A kernel change worth a few percent is lost in this kind of machine's drift between processes (±15% in an
hour); calls alternating within one process share that drift.

For each layer shape, row count and format it prints the median time of each version over the reps, and the median
and interquartile range of the per-rep ratio (this tree / the revision). Weights are random, quantized by this tree's
code (the two versions must share the layout). `--copies` distinct copies of each layer are walked in turn, so that
the weights come from memory, not from the caches (one copy: from the caches).

    .venv/bin/python scripts/ab_kernels.py --base HEAD [--isa avx2] [--shapes 8960x1536,1536x8960] [--rows 1,4]
        [--copies 12] [--reps 40] [--formats int4,int8] [--base-isa avx512-vnni]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from quickdraft.quant import int4, int8, vnni
from quickdraft.tools.runs import machine

ROOT = Path(__file__).resolve().parent.parent
CSRC = Path("quickdraft/quant/csrc")


def build(tag: str, sources: dict[str, str], flags: list[str], where: Path):
    """The kernels from `sources` (file name -> text) under the namespace quickdraft_ab_<tag>; their ops."""
    from torch.utils import cpp_extension

    directory = where / tag
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        if name == "kernels.cpp":
            text, count = re.subn(r"#define QD_LIBRARY \w+", f"#define QD_LIBRARY quickdraft_ab_{tag}", text)
            assert count, "kernels.cpp names its library with `#define QD_LIBRARY`"
        (directory / name).write_text(text)
    cpp_extension.load(name=f"quickdraft_ab_{tag}", sources=[str(directory / "kernels.cpp")], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
                       build_directory=str(directory))
    return getattr(torch.ops, f"quickdraft_ab_{tag}")


def layer_operands(fmt: str, n: int, k: int) -> tuple:
    """A random (n, k) layer's weight operands as quickdraft's layer holds them: int4 (packed, scales, lows), int8
    (codes, scales)."""
    layer = (int4.Int4Linear if fmt == "int4" else int8.Int8Linear)(torch.randn(n, k) * 0.02, None)
    operands, _ = layer.fused_operands()  # (int4: ..., bias; int8: codes, scales, unused, bias)
    return tuple(operands[:3] if fmt == "int4" else operands[:2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree's kernels with")
    ap.add_argument("--isa", default=vnni.isa(), choices=list(vnni.BUILDS), help="the tree's build")
    ap.add_argument("--base-isa", choices=list(vnni.BUILDS), help="the revision's build (default: --isa)")
    ap.add_argument("--shapes", default="8960x1536,1536x8960", help="N x K of each layer")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--formats", default="int4,int8")
    ap.add_argument("--copies", type=int, default=12, help="distinct copies of each layer walked per call (1: cached)")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()

    base_isa = args.base_isa or args.isa
    for isa in {args.isa, base_isa}:
        if (reason := vnni.BUILDS[isa].reason()) is not None:
            raise SystemExit(f"the {isa} kernels do not run here: {reason}")
    names = ["kernels.cpp", "simd.h"]
    shown = {n: subprocess.run(["git", "show", f"{args.base}:{CSRC / n}"], cwd=ROOT, capture_output=True, text=True)
             for n in names}
    if shown["kernels.cpp"].returncode != 0:
        raise SystemExit(f"{args.base} has no {CSRC / 'kernels.cpp'}: {shown['kernels.cpp'].stderr.strip()}")
    base = {n: r.stdout for n, r in shown.items() if r.returncode == 0}  # (simd.h came later than kernels.cpp)
    tree = {n: (ROOT / CSRC / n).read_text() for n in names}
    with tempfile.TemporaryDirectory(prefix="quickdraft-ab-") as tmp:
        ops = {"base": build("base", base, vnni.BUILDS[base_isa].flags, Path(tmp)),
               "tree": build("tree", tree, vnni.BUILDS[args.isa].flags, Path(tmp))}
        print(f"{machine()}, {torch.get_num_threads()} threads; this tree's {vnni.NAMES[args.isa]} build against "
              f"{args.base}'s {vnni.NAMES[base_isa]} build; {args.copies} copies of each layer, {args.reps} reps, "
              "medians")
        print(f"{'format':6s} {'N x K':>11s} {'rows':>4s} {args.base[:10]:>10s} ms {'tree':>8s} ms  tree/base "
              f"(median, IQR)")
        torch.manual_seed(0)
        for fmt in args.formats.split(","):
            for shape in args.shapes.split(","):
                n, k = (int(v) for v in shape.split("x"))
                one = layer_operands(fmt, n, k)
                layers = [tuple(t.clone() for t in one) for _ in range(args.copies)]
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k, dtype=torch.bfloat16)
                    times = {"base": [], "tree": []}
                    for rep in range(args.reps):
                        for which in (("base", "tree") if rep % 2 else ("tree", "base")):
                            op = getattr(ops[which], f"{fmt}_linear")
                            t0 = time.perf_counter()
                            for operands in layers:
                                op(x, *operands, None)
                            times[which].append(time.perf_counter() - t0)
                    ratios = sorted(t / b for t, b in zip(times["tree"], times["base"]))
                    q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
                    print(f"{fmt:6s} {shape:>11s} {rows:4d} {1e3 * statistics.median(times['base']):13.3f} "
                          f"{1e3 * statistics.median(times['tree']):11.3f}  {statistics.median(ratios):.3f} "
                          f"({q1:.3f}-{q3:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
