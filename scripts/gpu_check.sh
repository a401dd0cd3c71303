#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one prepared run within one budget (BUDGET, 520 s: every phase and its kill
# grace), so that it fits one device call and leaves time for a second try within the 15 minutes a task is lent:
#   0. preflight (scripts/gpu_preflight.py, seconds): versions, driver, GPU, CPU flags, compiler, the attention
#      backend taking each pass, the first Triton launch, every module and transformers class the run uses. Stops the
#      run (exit 2) only where every later phase would be meaningless (no torch, no CUDA device, quickdraft or pytest
#      broken); anything else missing is named (exit 1) and the run goes on.
#   1. kernels (tests/test_cuda.py -m kernels): each kernel and pass against its reference, graphs against eager
#      passes, the memory plan's refusal.
#   2. benchmark (scripts/gpu_bench.py): plain decode against the roofline in bf16 / int8 / int4, v(k), the default
#      pair's predicted speed-up, the 27B-class rows and the 24 GiB fit; bench.json rewritten after every row.
#   3. exactness (tests/test_cuda.py -m "not kernels"): speculation equal to plain decoding in every format, family
#      and drafter, decoding into a cache's last positions, host copies of slots, the pass that must not sync.
# A phase's limit is its share of the budget, and it ends no later than its share's deadline counted from the start:
# time a phase leaves goes to the later ones, and a slow start takes from them. pytest gets SIGINT at the limit (so
# it prints its summary and writes its junit file) and SIGKILL GRACE seconds later; each test has a limit too
# (pytest-timeout), and -v names each test as it starts. Everything goes to $OUT (the device tool brings it back, 8
# files at most): gpu_check.log, preflight.json, junit-kernels.xml, bench.json, junit-exact.xml, exact_diff.json (a
# speculative run that differed: where, on which path, by what margin), summary.txt (rewritten at each phase's start
# and end, so a run killed from outside still says where it was).
#
# quickdraft's CPU kernels (C++ extensions) are off: the CPU references and a CPU draft run PyTorch's own ops, so no
# compiler runs on the device's clock. Triton compiles the int8 kernel (seconds).
#
# Here, once:     scripts/gpu_prepare.sh   (the wheels the GPU image lacks and the reference files, into .gpu/)
# On the GPU:     the device tool's run, command "bash scripts/gpu_check.sh", carry [".gpu"], timeout_s 590
# CPU rehearsal:  bash scripts/gpu_check.sh --device cpu [--out DIR] [--carried]   (the same phases on the CPU, tiny
#                 stand-ins in the benchmark; CI runs it: tests/test_gpu_check.py); scripts/gpu_rehearse.sh runs it
#                 under the device's versions with cold caches
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
out=${OUT:-}
carried=
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --carried) carried=1; shift ;;  # install .gpu/whl with --target as on the device (default there)
        *) echo "usage: bash scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--carried]" >&2; exit 2 ;;
    esac
done
[ "$device" = cuda ] && carried=1
out=${out:-out/gpu_check}
mkdir -p "$out"
rm -f "$out/exact_diff.json"
exec > >(tee "$out/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "$device" = cpu ] && PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 QUICKDRAFT_TEST_DEVICE=$device
export QUICKDRAFT_CHECK_OUT=$out QUICKDRAFT_NO_VNNI=1 QUICKDRAFT_NO_AVX2=1

BUDGET=${GPU_CHECK_BUDGET:-520}  # seconds: the device call's timeout_s (590) less the start of the command
GRACE=10                         # seconds between a phase's SIGINT and its SIGKILL
names=(preflight kernels benchmark exactness)
shares=(10 18 34 38)             # percent of what the budget leaves after the four graces
deadlines=()
acc=0
for i in "${!names[@]}"; do
    acc=$(( acc + (BUDGET - ${#names[@]} * GRACE) * ${shares[$i]} / 100 + GRACE ))
    deadlines+=("$acc")
done

status=()
write_summary() {  # the phases ended so far, and the one running if any: rewritten at each change
    printf '%s\n' "${status[@]}" "$@" > "$out/summary.txt"
}
phase() {  # index, command...: runs it until its deadline, records its exit status and time against its limit
    local i=$1 name=${names[$1]} start=$SECONDS rc
    shift
    local planned=$(( (BUDGET - ${#names[@]} * GRACE) * ${shares[$i]} / 100 ))
    local limit=$(( ${deadlines[$i]} - GRACE - SECONDS ))
    (( limit < 5 )) && limit=5
    echo "== $name (limit ${limit} s; its share ${planned} s; ${SECONDS} s into the budget of ${BUDGET} s)"
    write_summary "$name: running since ${SECONDS} s (limit ${limit} s): killed from outside if no line follows"
    timeout -s INT -k "$GRACE" "$limit" "$@"
    rc=$?
    local took=$((SECONDS - start)) why=""
    (( rc == 124 || rc == 137 )) && why=" (killed at its limit)"
    status+=("$name: exit $rc in $took s of its $limit s limit$why")
    write_summary
    echo "== $name: exit $rc in $took s of its $limit s limit$why"
    return $rc
}

if [ -n "$carried" ] && compgen -G ".gpu/whl/*.whl" >/dev/null; then
    # exactly as on the device: no index, no dependencies, into a folder of its own put after the image's packages
    rm -rf /tmp/quickdraft-site
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/quickdraft-site \
        .gpu/whl/*.whl || echo "gpu_check: the carried wheels did not install (the preflight names what is missing)"
    export PYTHONPATH="$PYTHONPATH:/tmp/quickdraft-site"
fi
echo "gpu_check: $device, budget $BUDGET s, phase deadlines ${deadlines[*]} s; started $(date -u +%FT%TZ)"

PYTEST=($PY -m pytest -v -p no:cacheprovider tests/test_cuda.py -o junit_family=xunit1)
phase 0 $PY scripts/gpu_preflight.py --device "$device" --json "$out/preflight.json"
if [ "${status[0]#preflight: exit 2 }" != "${status[0]}" ]; then
    echo "gpu_check: the preflight found what makes every later phase meaningless: nothing else ran"
    exit 2
fi
if [ "$device" = cpu ]; then bench=(--quick -n 8 --runs 1); else bench=(-n 256); fi
phase 1 "${PYTEST[@]}" -m kernels --timeout 60 --junitxml "$out/junit-kernels.xml"
phase 2 $PY scripts/gpu_bench.py --device "$device" "${bench[@]}" --json "$out/bench.json"
phase 3 "${PYTEST[@]}" -m "not kernels" --timeout 90 --junitxml "$out/junit-exact.xml"
printf '%s\n' "${status[@]}"
failed=$(printf '%s\n' "${status[@]}" | grep -vc ": exit 0 ")
echo "gpu_check: $failed phase(s) failed in $SECONDS s; the log, junit files and bench.json are in $out"
exit $(( failed > 0 ))
