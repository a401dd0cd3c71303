"""bench, tune, verify and doctor on the real default pair, with short settings (the CLI paths are tested
on tiny models; here the pair is loaded once and the same functions run on it)."""

import pytest

import quickdraft
from quickdraft.tools import bench, doctor, roofline, tune
from quickdraft.config import SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.tools.prompts import encoded
from quickdraft.speculative.draft import Draft
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.tools.verify import verify
from tests.helpers import check_speedups

pytestmark = pytest.mark.slow

DRAFT = Draft.parse("qwen2.5-coder-0.5b")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair():
    llm = quickdraft.load("qwen2.5-coder-1.5b", "none", device="cpu", dtype="bfloat16", context=512, progress=False)
    (draft,) = llm.draft_models(DRAFT)
    return llm, draft, encoded(llm.tokenizer, ["code-en", "qa-zh"])


def test_bench_on_the_default_pair(pair, tmp_path):
    llm, draft, prompts = pair
    result = bench.run(llm, bench.parse_configs("plain,draft:k=4", DRAFT), {"code-en": prompts["code-en"]}, n=24,
                       runs=1)
    row = next(r for r in result["rows"] if r["config"] == "draft k=4")
    assert row["same_as_plain"] and row["acceptance"] > 0.3
    check_speedups(result["rows"], row)
    assert all(p.read_bytes()[:8] == PNG for p in bench.plots(result, tmp_path))


def test_tune_measures_the_default_pair(pair):
    llm, draft, prompts = pair
    target = llm.target
    t_plain, v = roofline.v_curve(target, prompts["code-en"], 4, reps=3)
    drafter = llm.drafter(Draft.parse("ngram+qwen2.5-coder-0.5b"))
    outputs, t_step = tune.reference(target, {"code-en": prompts["code-en"]}, 24)
    v_tree = roofline.v_tree(target, prompts["code-en"], 4, [2], reps=1)
    c, tree = tune.measure("ngram+draft", drafter, {"code-en": prompts["code-en"]}, outputs, t_plain, t_step, v, v_tree)
    assert c.coverage == 1.0 and c.r > 0 and c.acceptance[0] > 0.3
    assert set(c.predicted) == {1, 2, 3, 4} and all(x > 0 for x in c.predicted.values())  # speed: bench, not here
    # the same drafter as a tree of 2 (the draft model's rounds; n-gram lookup's stay chains): its own predictions
    assert (tree.tree, tree.acceptance, set(tree.predicted)) == (2, c.acceptance, {1, 2, 3, 4})
    assert 0 <= tree.alternatives <= 1 and set(v_tree[2]) == {1, 2, 3, 4}
    assert set(v) == {1, 2, 3, 4} and all(x > 0 for x in v.values()) and t_step > 0 and t_plain > 0


def test_verify_and_doctor_pass_on_the_default_pair(pair):
    llm, draft, prompts = pair
    target = llm.target
    drafter = llm.drafter(Draft.parse("ngram+qwen2.5-coder-0.5b"), SpeculationConfig(draft_max=8))
    engine = Engine(target, 512, drafter, SpeculationConfig(draft_max=8))
    report = verify(engine, {"qa-zh": prompts["qa-zh"]}, 12, 0.8, 8, 24, prompts["qa-zh"])
    assert report.passed, report.to_dict()
    findings = [doctor.placement(target.model, target.device, "target"), doctor.tokenizers(target, draft),
                doctor.memory(target, [draft], engine, doctor.device_memory(target.device)),
                doctor.sampler(drafter, target.config.vocab_size),
                doctor.speculation(engine, prompts["code-en"], n=24)]
    assert [f.level for f in findings[:4]] == ["ok"] * 4, findings
    assert findings[4].level != "error" and findings[4].figures["acceptance_rate"] > 0
    ngram = Engine(target, 512, NgramDrafter(), SpeculationConfig(draft_max=8))
    assert doctor.sampler(ngram.drafter, target.config.vocab_size).level == "ok"
