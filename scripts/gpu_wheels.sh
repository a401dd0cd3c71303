#!/usr/bin/env bash
# Wheels for a GPU machine without network (Python 3.12, x86-64): what gpu_check.sh needs beyond the GPU
# image. Run here, in the repository root; .whl/ is git-ignored, and travels when named in the device's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl gguf==0.19.0 llguidance==1.9.1
ls -l .whl
