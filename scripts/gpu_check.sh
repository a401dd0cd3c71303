#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one prepared run that fits 8 minutes on one H200 (about 9 with the machine's
# start), leaving a second try within the 15 minutes a task is lent:
#   0. preflight (scripts/gpu_preflight.py, seconds): versions of torch, CUDA, cuDNN, Triton, transformers; the
#      attention backends and which one takes each pass; every import the run needs. Stops the run (exit 2) if one
#      is missing, saying what to carry.
#   1. kernels (tests/test_cuda.py -m kernels): each kernel and pass against its reference, no sync in a graphed
#      pass, the memory plan's refusal.
#   2. benchmark (scripts/gpu_bench.py): plain decode against the roofline in bf16 / int8 / int4, v(k), the default
#      pair's predicted speed-up, the 27B-class case and its memory plan; its table prints last in its phase.
#   3. exactness (tests/test_cuda.py -m "not kernels"): greedy, seeded and sampled speculation equal to plain
#      decoding in every format and family.
# Each test has a timeout of its own (pytest-timeout) and each phase one (SIGINT first, so pytest still prints its
# summary and writes its junit file). Everything goes to $OUT (the device tool brings it back): gpu_check.log (the
# whole output), preflight.json, junit-kernels.xml, bench.json, junit-exact.xml, summary.txt.
#
# Here, once:     scripts/gpu_prepare.sh          (wheels the GPU image lacks and reference files, into .gpu/)
# On the GPU:     the device tool's run with command "bash scripts/gpu_check.sh", carry [".gpu"], timeout_s 540
# CPU rehearsal:  bash scripts/gpu_check.sh --device cpu [--out DIR]   (the same phases on the CPU in about 2
#                 minutes, tiny stand-ins in the benchmark; CI runs it: tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
out=${OUT:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "usage: bash scripts/gpu_check.sh [--device cuda|cpu] [--out DIR]" >&2; exit 2 ;;
    esac
done
out=${out:-out/gpu_check}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "$device" = cpu ] && PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QUICKDRAFT_TEST_DEVICE=$device
if compgen -G ".gpu/whl/*.whl" >/dev/null && [ "$device" = cuda ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/quickdraft-site \
        .gpu/whl/*.whl || { echo "gpu_check: the carried wheels did not install"; exit 2; }
    export PYTHONPATH="$PYTHONPATH:/tmp/quickdraft-site"
fi
if [ "$device" = cpu ]; then
    bench=(--quick -n 8 --runs 1); limits=(150 60 150)
else
    bench=(-n 256); limits=(90 220 200)
fi
status=()
phase() {  # name, seconds, command...: runs it under its limit, records its exit status and time
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout -s INT -k 15 "$limit" "$@"
    rc=$?
    status+=("$name: exit $rc in $((SECONDS - start)) s")
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    return $rc
}
phase preflight 60 $PY scripts/gpu_preflight.py --device "$device" --json "$out/preflight.json" || {
    printf '%s\n' "${status[@]}" > "$out/summary.txt"; echo "gpu_check: preflight failed: nothing else ran"; exit 2; }
phase kernels "${limits[0]}" $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -m kernels --timeout 60 \
    --junitxml "$out/junit-kernels.xml" -o junit_family=xunit1
phase benchmark "${limits[1]}" $PY scripts/gpu_bench.py --device "$device" "${bench[@]}" --json "$out/bench.json"
phase exactness "${limits[2]}" $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -m "not kernels" \
    --timeout 90 --junitxml "$out/junit-exact.xml" -o junit_family=xunit1
printf '%s\n' "${status[@]}" | tee "$out/summary.txt"
failed=$(printf '%s\n' "${status[@]}" | grep -vc ": exit 0 ")
echo "gpu_check: $failed phase(s) failed; the log, junit files and bench.json are in $out"
exit $(( failed > 0 ))
