"""scripts/gpu_check.sh, rehearsed on the CPU: the run a GPU machine gets once, with minutes to spare, must not fail
on a broken import, path or argument. The same phases (preflight, kernel tests, benchmark, exactness tests) and the
same outputs as on the GPU."""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import llamacpp

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # four processes, two of them pytest: about 90 s
def test_the_cpu_rehearsal_runs_every_phase_and_leaves_its_outputs(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=400,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-6000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["preflight", "kernels", "benchmark", "exactness"]
    assert all(": exit 0 " in line for line in summary), summary
    starts = re.findall(r"^== \w+ \(limit (\d+) s; its share \d+ s; (\d+) s into the budget of 520 s\)$",
                        (out / "gpu_check.log").read_text(), re.M)
    assert len(starts) == 4 and all(int(start) + int(limit) + 10 <= 520 for limit, start in starts), starts
    for junit in ("junit-kernels.xml", "junit-exact.xml"):
        suite = ET.parse(out / junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        assert int(suite.get("tests")) > 5 and suite.get("failures") == suite.get("errors") == "0", junit
    bench = json.loads((out / "bench.json").read_text())
    assert len(bench["decode"]) == 6 and not bench["graphs_off"] and set(bench["predicted"]) >= {"bf16", "int4"}
    assert [r["served"] for r in bench["decode"]][-2:] == ["graphs", "eager"]  # the 27B rows: dense, hybrid
    assert bench["fit_24gib"]["stage"] == "done" and bench["fit_24gib"]["plan_total_gib"] < 24
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["missing"] == preflight["fatal"] == [] and preflight["torch"] != "absent"
    assert "gpu_check:" in (out / "gpu_check.log").read_text() and not (out / "exact_diff.json").exists()


def test_the_preflight_stops_the_run_only_on_what_every_phase_needs_naming_what_to_carry(tmp_path):
    """A package the GPU image lacks stops the run in seconds where nothing could run without it (gguf: quickdraft's
    loader needs it), in one line with what to carry and what needed it."""
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf").joinpath("__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'gguf'\", name='gguf')\n")
    result = subprocess.run([sys.executable, "scripts/gpu_preflight.py", "--device", "cpu"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode == 2, result.stdout
    fatal = [ln for ln in result.stdout.splitlines() if "FATAL" in ln]
    assert fatal == ["preflight: FATAL gguf is missing (needed by quickdraft.api): carry its wheel: run "
                     "scripts/gpu_prepare.sh here and name .gpu in carry"], fatal


def test_a_package_some_tests_need_is_named_and_the_run_goes_on(monkeypatch):
    """dflash (the DFlash reference, which only its test imports): named with what to carry, never fatal."""
    preflight = _preflight()
    monkeypatch.setitem(sys.modules, "dflash", None)  # an import of it now fails as a missing package's does
    monkeypatch.delitem(sys.modules, "tests.test_dflash", raising=False)
    problem, package = preflight._import("tests.test_dflash")
    assert package == "dflash" and "carry its wheel" in problem and "tests.test_dflash" in problem


def _preflight():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_preflight
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_preflight


def test_the_preflight_finds_the_modules_the_run_imports_inside_its_functions():
    gpu_preflight = _preflight()
    used = gpu_preflight.modules_used()
    assert {"tests.test_dflash", "tests.llamacpp", "quickdraft.speculative.mtp", "gguf"} <= set(used), used
    assert {"Qwen3_5ForCausalLM", "Gemma4AssistantForCausalLM", "Qwen3MoeConfig"} <= set(
        gpu_preflight.transformers_classes())


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
