#!/usr/bin/env bash
# Create (or reuse) .venv and install quickdraft into it. Usage: scripts/setup-venv.sh [EXTRAS]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
py=.venv/bin/python
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
# PyTorch first, pinned: an unpinned torch would pull a multi-GB CUDA build where a CPU one will do.
if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$py" -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
