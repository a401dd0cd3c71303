"""scripts/gpu_check.sh, rehearsed on the CPU: the run a GPU machine gets once, with minutes to spare, must not fail
on a broken import, path or argument. The same phases (preflight, kernel tests, benchmark, exactness tests) and the
same outputs as on the GPU."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import llamacpp

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # four processes, two of them pytest: 40 s
def test_the_cpu_rehearsal_runs_every_phase_and_leaves_its_outputs(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=400,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-6000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["preflight", "kernels", "benchmark", "exactness"]
    assert all(": exit 0 " in line for line in summary), summary
    for junit in ("junit-kernels.xml", "junit-exact.xml"):
        suite = ET.parse(out / junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        assert int(suite.get("tests")) > 5 and suite.get("failures") == suite.get("errors") == "0", junit
    bench = json.loads((out / "bench.json").read_text())
    assert len(bench["decode"]) == 5 and not bench["graphs_off"] and set(bench["predicted"]) >= {"bf16", "int4"}
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["missing"] == [] and preflight["torch"] != "absent"
    assert "gpu_check:" in (out / "gpu_check.log").read_text()


def test_the_preflight_stops_the_run_naming_what_to_carry(tmp_path):
    """A package the GPU image lacks (gguf, here hidden) stops the run in seconds with what to do."""
    (tmp_path / "gguf.py").write_text("raise ImportError('not on this machine')\n")
    result = subprocess.run([sys.executable, "scripts/gpu_preflight.py", "--device", "cpu"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode == 2
    assert "MISSING cannot import gguf" in result.stdout and "scripts/gpu_prepare.sh" in result.stdout


def test_without_network_the_llama_cpp_case_is_skipped_saying_why(tmp_path, monkeypatch):
    """A GPU machine reaches no network: with no prepared file the converted-model test skips with its reason (it
    failed there every time); with one, the file is used as it is."""
    monkeypatch.setattr(llamacpp, "PREPARED", tmp_path / "ref")

    def offline():
        raise llamacpp.Unavailable("pip download failed: no network")

    monkeypatch.setattr(llamacpp, "tree", offline)
    with pytest.raises(pytest.skip.Exception, match="scripts/gpu_prepare.sh"):
        llamacpp.reference("qwen3_5-mtp", "q8_0", tmp_path)
    (tmp_path / "ref").mkdir()
    prepared = tmp_path / "ref" / "qwen3_5-mtp-q8_0.gguf"
    prepared.write_bytes(b"GGUF")
    assert llamacpp.reference("qwen3_5-mtp", "q8_0", tmp_path) == prepared
