#!/usr/bin/env bash
# Create (or reuse) .venv and install quickdraft into it. Usage: scripts/setup-venv.sh [EXTRAS]
# Quiet unless something fails: pip's own output goes to .venv/install.log and is shown only then.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
py=.venv/bin/python
log=.venv/install.log
: > "$log"
pip_install() {
    if ! "$py" -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "setup-venv: pip install $* failed (the log above is in $log)" >&2
        exit 1
    fi
}
pip_install --upgrade pip
# PyTorch first, pinned: an unpinned torch would pull a multi-GB CUDA build where a CPU one will do.
if ! "$py" -c "import torch" 2>/dev/null; then
    pip_install "torch==2.13.0"
fi
pip_install -e ".${extras:+[$extras]}"
# The DFlash drafters' reference implementation (tests/test_dflash.py), without the dataset and benchmark packages
# its wheel pins (its model code needs torch and transformers alone).
if [[ ",$extras," == *",test,"* ]]; then
    pip_install --no-deps "dflash==0.1.0"
    # vLLM's speculators library: the EAGLE-3, DFlash and DSpark heads' reference (tests/test_eagle3.py,
    # test_dspark.py). Its import reaches its training data modules, which import hs-connectors and datasets, and its
    # loading code loguru; its serving and training packages stay out.
    pip_install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
    pip_install "datasets==5.1.0" "loguru==0.7.3"  # (5.1.0: the first to allow the huggingface-hub transformers needs)
fi
