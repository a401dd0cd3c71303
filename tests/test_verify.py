"""`quickdraft verify` on tiny models: it passes an exact engine and fails one with a broken accept rule."""

import json

import pytest
import torch

import quickdraft.engine.verify
from quickdraft.config import EngineConfig, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.tools.verify import chi_square, verify
from quickdraft.weights.loader import load_model
from tests.helpers import cli, tiny_hf_model, write_gguf_from_hf

BF16 = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
PROMPTS = {"a": [5, 17, 250, 3, 99], "b": [42, 7, 5, 17, 250, 3, 11]}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    hf = tiny_hf_model("llama", seed=4, logit_scale=6)
    target = write_gguf_from_hf(hf, d / "t.gguf")
    torch.manual_seed(2)
    with torch.no_grad():  # a draft that often agrees with the target, and differs in distribution
        for p in hf.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    return target, write_gguf_from_hf(hf, d / "d.gguf")


@pytest.fixture(scope="module")
def engine(paths):
    target, draft = (load_model(str(p), BF16, False) for p in paths)
    return Engine(target, 128, DraftModelDrafter(draft, target.config.vocab_size, 128), SpeculationConfig(draft_max=6))


def test_an_exact_engine_passes(engine):
    torch.manual_seed(0)
    report = verify(engine, PROMPTS, 24, 1.0, 4, 200, PROMPTS["a"])
    assert report.passed, report.to_dict()
    assert len(report.greedy) == 4 and all(c.identical for c in report.greedy)
    assert report.distribution.rounds_exercised == 200 and report.distribution.dof >= 3


def test_a_broken_sampled_accept_rule_fails(engine, monkeypatch):
    def accept_everything(p_target, q_draft, drafts, generator):  # the classic bug: trusting the draft
        last = torch.multinomial(p_target[-1], 1, generator=generator)
        return drafts.tolist() + [int(last)], drafts.shape[0]

    monkeypatch.setattr(quickdraft.engine.verify, "accept_sampled", accept_everything)
    torch.manual_seed(0)
    report = verify(engine, PROMPTS, 8, 1.0, 4, 200, PROMPTS["a"])
    assert all(c.identical for c in report.greedy)  # greedy does not use the sampled rule
    assert not report.distribution.passed and not report.passed
    assert report.distribution.p_value < 1e-3


def test_a_broken_greedy_accept_rule_fails(engine, monkeypatch):
    def accept_all_drafts(target_argmax, drafts):
        return drafts.tolist() + [int(target_argmax[-1])], drafts.shape[0]

    monkeypatch.setattr(quickdraft.engine.verify, "accept_greedy", accept_all_drafts)
    report = verify(engine, PROMPTS, 24, 1.0, 4, 0, PROMPTS["a"])
    assert not report.passed and report.distribution is None
    broken = [c for c in report.greedy if not c.identical]
    assert broken and all(c.first_difference is not None for c in broken)


def test_trees_pass_and_a_broken_tree_rule_fails(engine, monkeypatch):
    """With --draft-tree verify checks trees: an exact engine passes; one whose tree rule trusts the first candidate
    fails the distribution check."""
    import dataclasses

    trees = Engine(engine.target, 128, engine.drafter, dataclasses.replace(engine.speculation, tree=3))
    torch.manual_seed(0)
    report = verify(trees, PROMPTS, 16, 1.0, 4, 200, PROMPTS["a"])
    assert report.passed, report.to_dict()

    def trust_the_first(p_rows, q_rows, tokens, parents, generator):  # the chain's draft, whatever the target says
        return [tokens[0], int(torch.multinomial(p_rows[1], 1, generator=generator))], [0, 1]

    monkeypatch.setattr(quickdraft.engine.verify, "accept_tree_sampled", trust_the_first)
    torch.manual_seed(0)
    report = verify(trees, PROMPTS, 8, 1.0, 4, 200, PROMPTS["a"])
    assert not report.distribution.passed and report.distribution.p_value < 1e-3


def test_chi_square_pools_rare_categories():
    probs = torch.tensor([0.5, 0.3, 0.19, 0.01], dtype=torch.float64)
    stat, dof, p = chi_square(torch.tensor([50.0, 30, 19, 1], dtype=torch.float64), probs)
    assert dof == 2 and stat < 1 and p > 0.5  # 0.01 * 100 < 5: pooled with the next rarest
    stat, dof, p = chi_square(torch.tensor([80.0, 10, 9, 1], dtype=torch.float64), probs)
    assert p < 1e-3


def test_verify_command(paths):
    target, draft = paths
    r = cli("verify", "-m", str(target), "--draft", str(draft), "-n", "8", "--draws", "60", "--prompts",
            "qa-en,code-zh", "--dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["passed"] and {c["prompt"] for c in out["greedy"]} == {"qa-en", "code-zh"}
    assert out["distribution"]["draws"] == 60 and "p_value" in out["distribution"]
    text = cli("verify", "-m", str(target), "--draft", str(draft), "-n", "4", "--draws", "0", "--prompts", "qa-en")
    assert text.returncode == 0 and "PASS" in text.stdout and "identical" in text.stdout
    none = cli("verify", "-m", str(target), "--draft", "none")
    assert none.returncode == 1 and "verify needs a draft" in none.stderr
