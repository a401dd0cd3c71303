"""`quickdraft tune`: the speed model, the reasons it gives, and the profile generate takes."""

import json

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.tune import Candidate, explain, predict, read_profile
from tests.helpers import tiny_hf_model, write_gguf_from_hf
from tests.test_cli import run


def test_the_speed_model():
    v = {1: 1.1, 2: 1.2, 3: 1.3}
    predicted = predict(v, 0.1, [0.8, 0.5, 0.0])
    assert predicted[1] == pytest.approx(1.8 / 1.2)
    assert predicted[2] == pytest.approx(2.2 / 1.4)
    assert predicted[3] == pytest.approx(2.2 / 1.6)  # a position never accepted only costs
    half = predict(v, 0.0, [1.0, 1.0, 1.0], coverage=0.5)  # rounds on half the steps, plain on the rest
    assert half[3] == pytest.approx((0.5 * 4 + 0.5) / (0.5 * 1.3 + 0.5))


def test_losers_are_explained():
    v = {1: 1.1, 2: 2.0}
    winner = Candidate("small", 0.05, [0.9, 0.8], best_k=2, best_speedup=2.0)
    slow = Candidate("big", 0.6, [0.95, 0.9], best_k=1, best_speedup=0.9)
    assert "too slow a draft" in explain(slow, v, winner)
    weak = Candidate("other", 0.05, [0.3, 0.2], coverage=0.3, best_k=2, best_speedup=0.8)
    assert "too low an acceptance" in explain(weak, v, winner) and "verification too costly" in explain(weak, v, winner)
    assert "too few proposals" in explain(weak, v, winner)
    rare = Candidate("ngram", 0.0, [0.9, 0.9], coverage=0.4, best_k=2, best_speedup=1.3)
    assert "fewer steps" in explain(rare, v, winner)
    close = Candidate("close", 0.05, [0.7, 0.6], best_k=2, best_speedup=1.6)
    assert "lower acceptance" in explain(close, v, winner)


def test_bad_profiles_say_what_to_do(tmp_path):
    with pytest.raises(QuickdraftError, match="no such profile"):
        read_profile(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(QuickdraftError, match="not JSON"):
        read_profile(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text('{"version": 0}')
    with pytest.raises(QuickdraftError, match="run tune again"):
        read_profile(tmp_path / "old.json")


def test_tune_writes_a_profile_that_generate_takes(tmp_path):
    path = write_gguf_from_hf(tiny_hf_model("llama", seed=8, logit_scale=6), tmp_path / "t.gguf")
    profile = tmp_path / "p.json"
    r = run("tune", "-m", str(path), "--draft", str(path), "--draft", "ngram", "--kmax", "4", "-n", "12",
            "--prompts", "qa-en,code-en", "--dtype", "bfloat16", "--profile", str(profile))
    assert r.returncode == 0, r.stderr
    assert "recommendation:" in r.stdout and "v(k)" in r.stdout
    p = json.loads(profile.read_text())
    assert set(p) >= {"version", "target", "draft", "ngram", "draft_max", "predicted_speedup", "measured_speedup",
                      "v", "candidates", "checked"}
    assert [c["name"] for c in p["candidates"]] == [str(path), "ngram"]
    assert all(len(c["acceptance"]) == 4 and c["best_k"] in range(1, 5) for c in p["candidates"])
    # the draft is the target itself: as costly as a target step, it cannot win
    assert p["candidates"][0]["r"] > 0.3 and p["candidates"][0]["why_not"]
    g = run("generate", "-m", str(path), "-p", "hello", "-n", "6", "--profile", str(profile), "--json",
            "--ignore-eos", "--dtype", "bfloat16")
    assert g.returncode == 0, g.stderr
    spec = json.loads(g.stdout)["spec"]
    if p["draft"] == "none":
        assert spec is None
    else:
        assert spec["drafter"] == p["draft"] and max(spec["k_history"]) <= p["draft_max"]
