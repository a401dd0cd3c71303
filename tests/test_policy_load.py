"""The adaptive policy under continuous load (tests/policy_load.py): two clients keep two requests always in flight, so
every choice is a batch's. The draft model is measured there for each client's text (no state the policy cannot
leave: probed under load, never left untimed), and every round it drafts has its reason. Whether its drafts pay
depends on the machine (on a 2-core AVX2 CPU a 0.5B draft's token costs half a target step and each drafted row of two
streams' pass a fifth of it: they do not, even copying text); the longer run (`python -m tests.policy_load --seconds
600`) measures it. Here a probe may lose up to a plain step's time per step waited (QUICKDRAFT_PROBE_SHARE 1, fifty
times the default), so that a minute shows the mechanism on the slowest machine kind (AVX2)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_under_continuous_load_the_draft_is_measured_for_each_text(real_model_path):
    real_model_path("qwen2.5-coder-1.5b")
    real_model_path("qwen2.5-coder-0.5b")
    r = subprocess.run([sys.executable, "-m", "tests.policy_load", "--seconds", "60", "--json"], capture_output=True,
                       text=True, timeout=900, env={**os.environ, "QUICKDRAFT_PROBE_SHARE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    predictable, unpredictable = report["predictable"], report["unpredictable"]
    assert predictable["requests"] >= 2 and unpredictable["requests"] >= 2
    assert predictable["rounds"] > 0 and unpredictable["rounds"] > 0  # both texts measured under load
    for client in (predictable, unpredictable):  # a predicted gain or a probe: never a guess, never a fixed k
        assert set(client["rounds_by_reason"]) <= {"gain", "probe"}, report
        assert client["decode_tok_s_median"] > 0
