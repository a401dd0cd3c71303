#!/usr/bin/env bash
# The test suite on a fresh machine: install with test extras, then pytest. The slow tests pull the
# real default models on first use; QUICKDRAFT_SKIP_SLOW=1 skips them. The chat page's browser test needs
# Debian's chromium and chromium-driver: installed here when apt-get can (as root or with sudo), else it is skipped
# with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    if command -v apt-get >/dev/null && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
        echo "test: installing chromium and chromium-driver (the chat page's browser test)" >&2
        { $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium chromium-driver; } \
            >/tmp/quickdraft-apt.log 2>&1 || echo "test: apt-get failed (see /tmp/quickdraft-apt.log): the browser test will be skipped" >&2
    else
        echo "test: no chromium/chromedriver and no apt-get as root: the browser test will be skipped" >&2
    fi
fi
scripts/setup-venv.sh test
exec .venv/bin/python -m pytest "$@"
