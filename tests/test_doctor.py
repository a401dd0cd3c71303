"""`quickdraft doctor` detects each fault it claims to: each test creates one and sees it reported."""

import json

import pytest
import torch

from quickdraft.tools import doctor
from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.speculative.base import Drafter, Proposal
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model, write_gguf_from_hf
from tests.helpers import cli

BF16 = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("doctor")
    hf = tiny_hf_model("llama", seed=5, logit_scale=6)
    return (write_gguf_from_hf(hf, d / "t.gguf"), write_gguf_from_hf(hf, d / "d.gguf"),
            save_hf_dir(tiny_hf_model("llama", seed=6), d / "other"))  # word-level vocabulary: incompatible


@pytest.fixture(scope="module")
def models(paths):
    return [load_model(str(p), BF16, False) for p in paths]


def test_weights_off_the_intended_device_are_reported(models):
    target = models[0]
    assert doctor.placement(target.model, CPU, "target").level == "ok"
    model = tiny_hf_model("llama")  # an nn.Module with one layer left elsewhere
    model.model.layers[1].to("meta")
    finding = doctor.placement(model, CPU, "target")
    assert finding.level == "error" and "on meta" in finding.message
    assert finding.figures["bytes_by_device"]["meta"] > 0


def test_a_draft_on_another_device_is_reported():
    assert doctor.draft_device(CPU, CPU).level == "ok"
    finding = doctor.draft_device(CPU, torch.device("meta"))
    assert finding.level == "warn" and "--draft-device" in finding.message
    finding = doctor.draft_device(torch.device("cuda:0"), CPU)
    assert finding.level == "warn" and "slower device" in finding.message


def test_a_memory_budget_over_the_limit_is_reported(models):
    target, draft, _ = models
    engine = Engine(target, 128, DraftModelDrafter(draft, target.config.vocab_size, 128), SpeculationConfig())
    fine = doctor.memory(target, [draft], engine, 2**34)
    need = fine.figures["total_bytes"]
    assert fine.level == "ok" and fine.figures["kv_cache_bytes"] > 0 and fine.figures["weights_bytes"] > 0
    assert doctor.memory(target, [draft], engine, int(need / 0.95)).level == "warn"
    over = doctor.memory(target, [draft], engine, need // 2)
    assert over.level == "error" and "does not fit" in over.message and "--ctx" in over.message


def test_a_draft_with_another_tokenizer_is_reported(models):
    target, draft, other = models
    assert doctor.tokenizers(target, draft).level == "ok"
    finding = doctor.tokenizers(target, other)
    assert finding.level == "error" and "differs" in finding.message


def test_a_draft_that_ignores_the_sampler_settings_is_reported(models, monkeypatch):
    target, draft, _ = models
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 128)
    assert doctor.sampler(drafter, target.config.vocab_size).level == "ok"
    import quickdraft.speculative.draft_model as dm

    monkeypatch.setattr(dm.sampling, "process", lambda logits, params, history=None: logits.float().softmax(-1))
    finding = doctor.sampler(drafter, target.config.vocab_size)
    assert finding.level == "error" and max(finding.figures["candidates_per_position"]) > 3


def test_speculation_that_never_lands_is_reported(models):
    target, draft, _ = models
    prompt = [5, 17, 250, 3]
    good = Engine(target, 128, DraftModelDrafter(draft, target.config.vocab_size, 128), SpeculationConfig(draft_max=4))
    finding = doctor.speculation(good, prompt)
    assert finding.figures["acceptance_rate"] > 0.9  # the draft is the target...
    assert finding.level != "error" and "predicted_speedup" in finding.figures  # ...but costs as much: maybe warn

    plain = [e.token for e in Engine(target, 128).generate(prompt, SamplingParams(max_tokens=40, stop_at_eos=False))]
    never = next(t for t in range(target.config.vocab_size) if t not in plain)

    class Wrong(Drafter):  # drafts a token the target never chooses here
        sources, name = ("draft",), "wrong"

        def propose(self, seq, k_for, params, generator, constraint=None):
            return Proposal([never] * max(k_for("draft"), 1), "draft")

    finding = doctor.speculation(Engine(target, 128, Wrong(), SpeculationConfig(draft_max=4)), prompt)
    assert finding.level == "error" and "not working" in finding.message


def test_doctor_command(paths):
    target, draft, other = paths
    r = cli("doctor", "-m", str(target), "--draft", str(draft), "--dtype", "bfloat16", "--ctx", "128", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and {f["check"] for f in out["findings"]} >= {
        "memory plan", "target placement", "draft placement", "draft device", "tokenizer", "memory", "sampler",
        "speculation"}
    small = cli("doctor", "-m", str(target), "--draft", str(draft), "--ctx", "128", "--device-memory", "0.0001")
    assert small.returncode == 1 and "ERROR memory plan" in small.stdout and "do not fit" in small.stdout
    assert "not loaded: the plan does not fit" in small.stdout
    bad = cli("doctor", "-m", str(target), "--draft", str(other), "--ctx", "128")
    assert bad.returncode == 1 and "ERROR tokenizer" in bad.stdout


def test_cpu_kernels_off_are_reported_with_the_fix(models, monkeypatch):
    from quickdraft.quant import vnni

    target = models[0]
    if vnni.available():
        assert doctor.kernels(target).level == "ok"
    monkeypatch.setattr(vnni, "available", lambda: False)
    monkeypatch.setattr(vnni, "unavailable_reason", lambda: "building vnni.cpp failed: g++: not found")
    finding = doctor.kernels(target)
    assert finding.level == "warn" and "install a C++ compiler" in finding.message
    monkeypatch.setattr(vnni, "unavailable_reason", lambda: "this CPU lacks avx512_vnni")
    assert "nothing to install" in doctor.kernels(target).message


def test_the_kernel_path_and_whether_it_is_exact_are_named(paths, monkeypatch):
    """bf16 on VNNI and float32 on the AVX2 kernels are exact (tests/test_exact_everywhere.py proves it); float32 on
    PyTorch's GEMM is not, nor bf16 weights on PyTorch's emulated bf16 GEMM (a CPU without AVX-512: the layers are
    named), and doctor warns with the paths that are."""
    from dataclasses import replace

    from quickdraft.quant import avx2, vnni

    float32 = load_model(str(paths[0]), replace(BF16, dtype="float32"), False)
    if avx2.available():
        finding = doctor.exactness(float32)
        assert finding.level == "ok" and finding.message.startswith("AVX2 float32 kernels") and "bit-exact" in finding.message
    if vnni.available():
        bf16 = doctor.exactness(load_model(str(paths[0]), BF16, False))
        if vnni.isa_name() == "AVX2":  # layers the int kernels refuse (this tiny model's): PyTorch's emulated bf16
            assert not bf16.figures["bit_exact"] and "linear layers run on PyTorch's emulated bf16" in bf16.message
        else:
            assert bf16.figures["bit_exact"]
    monkeypatch.setattr(avx2, "available", lambda: False)
    finding = doctor.exactness(float32)
    assert finding.level == "warn" and "NOT proven bit-exact" in finding.message and "AVX2" in finding.message
    assert finding.figures == {"path": "generic (PyTorch's kernels), float32 compute", "dtype": "float32",
                               "bit_exact": False}


def test_loading_says_converted_or_read_back_and_warns_when_graphs_are_off(paths, tmp_path, monkeypatch):
    from dataclasses import replace

    from quickdraft.weights import converted

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(converted, "MIN_BYTES", 0)
    int8 = EngineConfig(**{**BF16.__dict__, "weights": "int8"})
    first, second = load_model(str(paths[0]), int8, False), load_model(str(paths[0]), int8, False)
    finding = doctor.loading(first, second)
    assert finding.level == "ok" and "converted to int8" in finding.message
    assert "read back its kept int8 conversion" in finding.message
    assert [m["kept_from"] is not None for m in finding.figures["models"]] == [False, True]

    class Graphs:  # what runtime.graphs.StepGraphs holds once its check turned it off
        disabled = "RuntimeError: its logits differ"

    second.graphs = Graphs()
    try:
        finding = doctor.loading(replace(second, name="on-gpu"))
    finally:
        second.graphs = None
    assert finding.level == "warn" and "its logits differ" in finding.message
