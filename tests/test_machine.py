"""This machine's kernels measured once and kept (weights/machine.py), and the defaults they choose."""

import json

import pytest

from quickdraft.quant import vnni
from quickdraft.weights import machine

needs_kernels = pytest.mark.skipif(not vnni.available(), reason="quickdraft's CPU kernels do not run here")


def figures(int4_step, int4_verify, int8_step, int8_verify):
    return {"threads": 2, "measured": "today", "seconds_per_weight": {
        "int4": {"1": int4_step, "5": int4_verify}, "int8": {"1": int8_step, "5": int8_verify}}}


def test_a_4_bit_target_takes_int4_only_where_it_is_measured_faster():
    counts = {"mixed": {"int4": 800, "int8": 200}, "int4": {"int4": 1000}}
    fmt, why = machine.target_format(counts, figures(20, 35, 40, 55))  # int4 half as dear a weight
    assert fmt == "int4" and "in int4" in why and "in mixed" in why
    fmt, _ = machine.target_format(counts, figures(25, 60, 27, 45))  # int4's verification costs more: mixed
    assert fmt == "mixed"
    fmt, _ = machine.target_format(counts, figures(25, 42, 26, 43))  # within the margin: the file's own quality
    assert fmt == "mixed"


@needs_kernels
def test_the_figures_are_measured_once_and_kept(tmp_path):
    said = []
    found = machine.figures(tmp_path, said.append)
    assert len(said) == 1 and "measuring" in said[0]
    per = found["seconds_per_weight"]
    assert 0 < per["int4"]["1"] < 1e-8 and 0 < per["int8"]["5"] < 1e-8 and found["threads"] >= 1
    kept = json.loads((tmp_path / "machine" / f"{machine.key()}.json").read_text())
    assert kept == found and machine.figures(tmp_path, said.append) == found and len(said) == 1


@needs_kernels
def test_a_models_weights_are_priced_by_the_figures_of_the_kernels_that_run_them(tmp_path):
    """weight_seconds: a pass of r rows over a model's linear weights at the figures' seconds per weight of each
    kind (linear in the rows between and beyond those measured); None for a model mostly on other kernels."""
    from quickdraft.config import EngineConfig
    from quickdraft.weights.loader import load_model
    from tests.helpers import save_hf_dir, tiny_hf_model

    hf = tiny_hf_model("qwen2", seed=3, vocab=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2)
    path = str(save_hf_dir(hf, tmp_path / "m"))
    found = figures(20e-12, 60e-12, 40e-12, 70e-12)
    config = EngineConfig(device="cpu", dtype="bfloat16", weights="int4", max_context=64)
    model = load_model(path, config, False).model
    n = sum(m.out_features * m.in_features for m in model.modules() if getattr(m, "format", None) == "int4")
    seconds = machine.weight_seconds(model, found)
    assert n > 0 and seconds(1) == pytest.approx(n * 20e-12) and seconds(5) == pytest.approx(n * 60e-12)
    assert seconds(3) == pytest.approx(n * 40e-12) and seconds(9) == pytest.approx(n * 100e-12)
    bf16 = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=64), False)
    assert machine.weight_seconds(bf16.model, found) is None


def test_an_unwritable_cache_directory_only_costs_a_measurement(tmp_path, monkeypatch):
    """The figures are measured (once a process) and used where they cannot be kept; the reason is said."""
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setattr(machine, "measure", lambda: {"threads": 1, "seconds_per_weight": {}, "measured": "now"})
    monkeypatch.setattr(vnni, "available", lambda: True)
    monkeypatch.setattr(machine, "_MEASURED", {})
    said = []
    found = machine.figures(blocked, said.append)
    assert found["threads"] == 1 and len(said) == 2 and "cannot keep them" in said[1]
    assert machine.figures(blocked, said.append) is found and len(said) == 2  # measured once in this process


def test_the_key_names_the_cpus_this_process_may_use(monkeypatch):
    from quickdraft.quant import calibrate

    mine = machine.key()
    monkeypatch.setattr(calibrate, "usable_cpus", lambda: 1000)
    assert machine.key() != mine
