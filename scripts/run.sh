#!/usr/bin/env bash
# The main job on a fresh machine: install, pull the default target and draft (sha256-checked), then serve
# the OpenAI-compatible API on 127.0.0.1:8000 with the draft speculating. Extra arguments go to `serve`
# (e.g. --port 9000, --api-key KEY). `quickdraft demo` is the one-shot alternative without a server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
.venv/bin/quickdraft pull
exec .venv/bin/quickdraft serve "$@"
