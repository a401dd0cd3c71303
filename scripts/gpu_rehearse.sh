#!/usr/bin/env bash
# scripts/gpu_check.sh rehearsed on the CPU under the GPU image's versions (torch 2.11.0, triton 3.6.0, transformers
# 5.17.0; its other packages as near as PyPI has them for this Python), with cold extension and Triton caches and the
# carried wheels installed with --target as on the device; prints each phase's time against its limit and the size
# of what the device call sends (the working tree plus .gpu).
#
# The environment (GPU_VENV, default .venv-gpu, git-ignored) is made on first use from PyPI: torch 2.11.0 there is
# its CUDA 13 build (about 4 GB with its libraries), which runs on a CPU. gguf, llguidance and dflash are left out of
# it on purpose: as on the device, they come from .gpu/whl (scripts/gpu_prepare.sh, run here when .gpu is absent).
# Usage: scripts/gpu_rehearse.sh [--out DIR]   (a few minutes; on a shared machine wrap it in flock)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GPU_VENV:-.venv-gpu}
out=out/gpu_rehearsal
[ "${1:-}" = --out ] && out=$2
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0
    # the image's other packages the run uses (numpy 2.5 needs Python 3.12: the nearest here is taken)
    "$venv/bin/pip" install -q tokenizers==0.23.2 safetensors==0.8.0 "numpy<2.6" jinja2 rich pytest pytest-timeout \
        hypothesis psutil accelerate sentencepiece protobuf ninja prometheus-client pytest-xdist pytest-cov \
        pytest-benchmark pytest-mock  # the image's pytest plugins: they load in its runs too
fi
[ -d .gpu/whl ] || scripts/gpu_prepare.sh
cold=$(mktemp -d)
trap 'rm -rf "$cold"' EXIT
export TORCH_EXTENSIONS_DIR=$cold/torch_extensions TRITON_CACHE_DIR=$cold/triton HF_HOME=$cold/hf
rm -rf "$out"
status=0
PYTHON=$venv/bin/python bash scripts/gpu_check.sh --device cpu --carried --out "$out" || status=$?
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
carried=$(du -sb .gpu | cut -f1)
echo "gpu_rehearse: what the device call sends: the tree $((tree / 1024)) KiB + .gpu $((carried / 1024)) KiB" \
     "= $(( (tree + carried) / 1048576 )).$(( (tree + carried) % 1048576 * 10 / 1048576 )) MiB of 64 MiB"
exit $status
