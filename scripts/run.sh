#!/usr/bin/env bash
# The main job on a fresh machine: install, pull the default target and draft (sha256-checked), run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
exec .venv/bin/quickdraft demo "$@"
