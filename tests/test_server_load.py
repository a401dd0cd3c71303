"""The load test (tests/load_test.py) as part of the suite: 64 concurrent streams, 8 cancelled mid-way."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_64_concurrent_streams_lose_nothing_and_memory_returns(real_model_path):
    real_model_path("smollm2-135m")
    r = subprocess.run([sys.executable, "-m", "tests.load_test", "--json", "--requests", "64", "--cancel", "8",
                        "--max-tokens", "12"], capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    assert report["problems"] == [] and report["server_alive"]
    assert report["completed"] == 56 and report["cancelled"] == 8
