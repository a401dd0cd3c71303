"""The adaptive policy under continuous load (tests/policy_load.py): two clients keep two requests always in flight, so
every choice is a batch's. The draft model is timed and measured there (no state the policy cannot leave): it drafts
for gain on text it predicts, and on text it cannot it does no more than probe."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_under_continuous_load_the_draft_drafts_where_it_pays_and_only_probes_where_it_does_not(real_model_path):
    real_model_path("qwen2.5-coder-1.5b")
    real_model_path("qwen2.5-coder-0.5b")
    r = subprocess.run([sys.executable, "-m", "tests.policy_load", "--seconds", "75", "--json"], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    predictable, unpredictable = report["predictable"], report["unpredictable"]
    assert predictable["requests"] >= 2 and unpredictable["requests"] >= 2
    assert predictable["reasons"].get("gain", 0) > 0 and predictable["acceptance"] > 0.6, predictable
    assert set(unpredictable["reasons"]) <= {"probe"}, unpredictable  # never drafted for a gain it cannot have
    assert unpredictable["rounds"] < predictable["rounds"]
