"""`quickdraft bench` on tiny models: the documented JSON fields, valid PNG plots, and configurations parsed."""

import json

import pytest

from quickdraft.tools import bench
from quickdraft.api import LLM
from quickdraft.config import EngineConfig, SpeculationConfig
from quickdraft.errors import QuickdraftError
from quickdraft.speculative.draft import Draft
from quickdraft.weights.loader import load_model
from tests.helpers import check_speedups, cli, tiny_hf_model, write_gguf_from_hf

PNG = b"\x89PNG\r\n\x1a\n"
ROW_FIELDS = {"prompt", "config", "decode_tok_s", "decode_min", "decode_max", "e2e_tok_s", "ttft_s", "acceptance",
              "tokens_per_round", "k_mean", "accept_per_position", "same_as_plain", "speedup", "predicted_speedup"}


def test_configurations_parse_and_bad_ones_say_how():
    configs = bench.parse_configs("plain, draft:k=4,ngram+draft:adaptive,draft:adaptive:vocab=64",
                                  Draft.parse("some-draft"))
    assert [c.name for c in configs] == ["plain", "draft k=4", "ngram+draft adaptive", "draft adaptive vocab=64"]
    assert [c.vocab for c in configs] == [None, None, None, 64]
    assert bench._speculation(configs[3], SpeculationConfig()).draft_vocab == 64
    assert bench._speculation(configs[1], SpeculationConfig(draft_vocab=32)).draft_vocab == 32  # the run's
    (lookup,) = bench.parse_configs("ngram:adaptive", Draft.parse("some-draft"))
    assert bench._speculation(lookup, SpeculationConfig(draft_vocab=32)).draft_vocab == 0  # no head to cut
    for bad in ("draft", "draft:k=0", "eagle:k=2", "draft:k=x", "ngram:adaptive:vocab=64", "draft:k=2:vocab=x",
                "draft:k=2:v=3"):
        with pytest.raises(QuickdraftError, match="bad configuration"):
            bench.parse_configs(bad, Draft.parse("some-draft"))


def test_bench_reports_every_field_and_draws_valid_plots(tmp_path):
    hf = tiny_hf_model("llama", seed=7, logit_scale=6)
    path = write_gguf_from_hf(hf, tmp_path / "t.gguf")
    config = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
    llm = LLM(load_model(str(path), config, False), config)
    draft = Draft.parse(str(path), weights="bf16")  # the target itself drafts
    configs = bench.parse_configs("plain,draft:k=2,draft:k=4,draft:adaptive,ngram+draft:adaptive", draft)
    prompts = {"a": [5, 17, 250, 3, 99, 5, 17], "b": [42, 7, 11, 64]}
    result = bench.run(llm, configs, prompts, n=12, runs=2, speculation=SpeculationConfig(p_min=0.0))
    assert len(result["rows"]) == 10 and ROW_FIELDS <= set(result["rows"][0])
    k4 = next(r for r in result["rows"] if r["config"] == "draft k=4" and r["prompt"] == "a")
    assert k4["same_as_plain"] and k4["acceptance"] > 0.9
    check_speedups(result["rows"], k4)
    assert [s["config"] for s in result["summary"]] == [c.name for c in configs]
    assert all(s["all_same_as_plain"] for s in result["summary"])
    assert "medians over prompts" in bench.table(result)
    paths = bench.plots(result, tmp_path / "plots")
    assert {p.name for p in paths} == {"tokps_vs_k.png", "acceptance_by_position.png", "predicted_vs_measured.png"}
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_bench_command(tmp_path):
    path = write_gguf_from_hf(tiny_hf_model("llama", seed=7), tmp_path / "t.gguf")
    r = cli("bench", "-m", str(path), "--draft", str(path), "--configs", "plain,draft:k=3", "--prompts", "qa-en",
            "-n", "6", "--runs", "1", "--json", str(tmp_path / "b.json"), "--plots", str(tmp_path / "p"),
            "--roofline")
    assert r.returncode == 0, r.stderr
    assert "draft k=3" in r.stdout and "medians over prompts" in r.stdout and "roofline: memory bandwidth" in r.stdout
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["configs"] == ["plain", "draft k=3"] and out["rows"][1]["same_as_plain"] is True
    roof = out["roofline"]
    assert set(roof) >= {"bandwidth_gb_s", "target_pass_bytes", "draft_pass_bytes", "plain_limit_tok_s", "v"}
    assert roof["bandwidth_gb_s"] > 0.1 and sorted(map(int, roof["v"])) == list(range(1, 17))
    plain, spec = out["rows"]
    assert plain["bytes_per_token"] == pytest.approx(roof["target_pass_bytes"])  # one target pass per token
    # a round reads the target once and the draft (the same file, int4 as a draft) once per drafted token
    assert roof["draft_pass_bytes"] < roof["target_pass_bytes"]
    assert spec["bytes_per_token"] == pytest.approx(
        ((spec["rounds"] + spec["plain_steps"]) * roof["target_pass_bytes"]
         + spec["draft_passes"] * roof["draft_pass_bytes"]) / spec["n_decoded"])
    assert (tmp_path / "p" / "tokps_vs_k.png").read_bytes()[:8] == PNG
    bad = cli("bench", "-m", str(path), "--configs", "draft:k=2")
    assert bad.returncode == 1 and "needs a draft" in bad.stderr
