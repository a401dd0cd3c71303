#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that has no network, prepared here in one command, into .gpu/
# (git-ignored; the device tool's `carry` takes it along: about 4 MiB):
#   .gpu/whl  wheels of the packages the GPU image lacks (Python 3.12, x86-64): gguf, llguidance and dflash (the DFlash
#             drafters' reference, whose random drafters tests/test_cuda.py builds)
#   .gpu/ref  reference files the tests would otherwise make with a download: the tiny qwen3.5 with its MTP block as
#             llama.cpp's own converter writes it in q8_0 (tests/llamacpp.reference)
# Usage: scripts/gpu_prepare.sh   (after scripts/setup-venv.sh test; needs PyPI once, for the wheels and the converter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/ref
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl gguf==0.19.0 llguidance==1.9.1 dflash==0.1.0
"$PY" - <<'PY'
import tempfile
from pathlib import Path

from tests import llamacpp

for name in llamacpp.REFERENCES:
    with tempfile.TemporaryDirectory() as tmp:
        made = llamacpp.reference(name, "q8_0", Path(tmp))
        made.replace(llamacpp.PREPARED / made.name)
PY
du -sh .gpu; ls -l .gpu/whl .gpu/ref
