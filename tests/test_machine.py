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
