#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one run (under 8 minutes on one H200): the correctness tests on CUDA (bf16 and
# the quantized formats: layers against their dequantized reference, GGUF 4-bit blocks loaded as they are, greedy
# and seeded speculation equal to plain in int8 / int4 / mixed, the chi-square test in int4, the memory plan's
# refusal), then the benchmark (scripts/gpu_bench.py: plain decode against the roofline in bf16 / int8 / int4,
# v(k), the default pair's predicted speed-up, the seeds' 27B-class case with its memory plan), whose table
# prints last.
#
# Needs PyTorch with CUDA, numpy, transformers and pytest (a GPU image has them); no network. Packages the
# machine lacks (gguf, and llguidance for grammar tests) travel as wheels in .whl/: fetch them here first
# with scripts/gpu_wheels.sh. Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/quickdraft-site \
        .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/quickdraft-site"
fi
$PY -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'); sys.exit(0 if torch.cuda.is_available() else 2)" || {
    echo "gpu_check: PyTorch sees no CUDA device"; exit 2; }
echo "== correctness on CUDA (tests/test_cuda.py)"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py
tests=$?
echo "== benchmark"
timeout 220 $PY scripts/gpu_bench.py -n 256
bench=$?
echo "gpu_check: tests exit $tests, benchmark exit $bench"
exit $(( tests != 0 || bench != 0 ))
