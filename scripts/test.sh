#!/usr/bin/env bash
# The test suite on a fresh machine: install with test extras, then pytest. The slow tests pull the
# real default models on first use; QUICKDRAFT_SKIP_SLOW=1 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh test
exec .venv/bin/python -m pytest "$@"
