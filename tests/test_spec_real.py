"""On the real default pair: greedy speculative output equals plain greedy output, token for token, with
and without a grammar; constrained samples are always valid with speculation on. And bench, tune, verify and doctor
on the same pair, loaded once, with short settings (the CLI paths are tested on tiny models; here the same functions
run on it)."""

import json

import jsonschema
import pytest

import quickdraft
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.grammar import Grammar
from quickdraft.tools import bench, doctor, roofline, tune
from quickdraft.tools.prompts import encoded
from quickdraft.tools.quality import TEXT as QUALITY_TEXT
from quickdraft.tools.verify import verify
from quickdraft.speculative.combined import CombinedDrafter
from quickdraft.speculative.draft import Draft
from quickdraft.speculative.ngram import NgramDrafter
from tests.helpers import check_speedups

pytestmark = pytest.mark.slow

ARTICLE = QUALITY_TEXT.read_text(encoding="utf-8").split("\n\n")[:2]
PROMPTS = {
    "code": "Write a Python class for a least-recently-used cache with get and put methods, with comments.",
    "chinese": "请用中文详细解释快速排序算法的原理，并分析它的时间复杂度。",
    "summary": "Summarize the following text in a few sentences, reusing its wording:\n\n" + "\n\n".join(ARTICLE),
}
N = 40  # past the first rounds' commits and rollbacks on each prompt; the summary's copied wording


@pytest.fixture(scope="module")
def llm():
    return quickdraft.load("qwen2.5-coder-1.5b", "none", device="cpu", dtype="bfloat16", context=1024, progress=False)


@pytest.fixture(scope="module")
def target(llm):
    return llm.target


@pytest.fixture(scope="module")
def draft(llm):
    return llm.drafter("qwen2.5-coder-0.5b", SpeculationConfig(draft_max=8))


@pytest.fixture(scope="module")
def prompts(target):
    tok = target.tokenizer
    return {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
            for name, text in PROMPTS.items()}


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = Engine(target, 1024)
    return {name: _tokens(engine, p) for name, p in prompts.items()}


def _tokens(engine, prompt):
    events = list(engine.generate(prompt, SamplingParams(max_tokens=N, stop_at_eos=False)))
    return [e.token for e in events if e.token is not None], events[-1].stats


@pytest.mark.parametrize("kind", ["draft-model", "ngram", "combined"])
def test_greedy_speculative_equals_plain_on_real_pair(target, draft, prompts, plain, kind):
    """Lookup alone and the draft model alone at a fixed k (the rounds are what they need); the chain as users run it,
    the adaptive default starting from this machine's prices (api.prior): the output is plain decoding's, and every
    round it drafted has its reason, one the policy's rules give with prices (a predicted gain, or a probe where plain
    decoding wins: never an unpriced guess)."""
    from quickdraft.api import prior

    combined = kind == "combined"
    drafter = {"draft-model": draft, "ngram": NgramDrafter(), "combined": CombinedDrafter(NgramDrafter(), draft)}[kind]
    spec = SpeculationConfig() if combined else SpeculationConfig(draft_max=8, adaptive=False)
    engine = Engine(target, 1024, drafter, spec, prior=prior(target, drafter) if combined else None)
    accepted = {}
    for name, prompt in prompts.items():
        tokens, stats = _tokens(engine, prompt)
        expected, _ = plain[name]
        assert len(tokens) == N
        assert tokens == expected, f"{name}: first difference at {_first_difference(tokens, expected)}"
        if not combined:
            assert stats.rounds > 0, f"{name}: nothing was verified, so nothing was tested"
        else:
            reasons = stats.policy["reasons"]
            assert all(set(r) <= {"gain", "probe"} for r in reasons.values()), reasons
            assert set(stats.sources) - {"target"} <= set(reasons), (stats.sources, reasons)
        accepted[name] = stats.draft_n_accepted
    # Rejected drafts test the rollback; accepted ones the commit. Whether n-grams match free Chinese prose
    # depends on the exact greedy text, which differs between CPUs (their kernels round differently), so
    # acceptance is required on the prompt built to be copied from, not on every prompt; and of the fixed-k
    # drafters only: in 40 tokens the adaptive chain may rightly leave a match undrafted (its measured prices, which
    # differ between machines, and what the earlier prompts taught it decide), and asking it to draft is not asking
    # for exactness.
    if not combined:
        assert accepted["summary"] > 0, accepted


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "year", "skills"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                         "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
EXTRACT = ("Extract the person's name, city, the year they joined and their skills as JSON.\n\nText: Maria Lopez "
           "joined Northwind Analytics in Lisbon in 2019; she works with Python, Spark and PostgreSQL.")


def _valid(value):
    jsonschema.validate(value, SCHEMA)  # an independent validator
    return True


def test_structured_output_on_real_pair(target, draft):
    """Seeded samples with speculation (n-gram + draft, adaptive): every one parses and fits the schema;
    greedy constrained output is the same with speculation on and off."""
    tok = target.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": EXTRACT}]))
    spec = Grammar.json_schema(SCHEMA)
    engine = Engine(target, 1024, CombinedDrafter(NgramDrafter(), draft), SpeculationConfig(draft_max=8))

    def run(engine, params):
        events = list(engine.generate(prompt, params, constraint=engine.constraint(spec)))
        return [e.token for e in events if e.token is not None], "".join(e.text for e in events), events[-1]

    accepted = 0
    for seed in range(4):
        _, text, final = run(engine, SamplingParams(temperature=0.8, max_tokens=80, seed=seed))
        assert final.finish_reason == "stop", text
        assert _valid(json.loads(text)), text
        accepted += final.stats.draft_n_accepted
    assert accepted > 0  # speculation stayed on under the grammar
    greedy = SamplingParams(max_tokens=80)
    tokens, text, final = run(engine, greedy)
    plain, _, _ = run(Engine(target, 1024), greedy)
    assert tokens == plain, text
    assert final.finish_reason == "stop" and _valid(json.loads(text)) and "Lisbon" in text


def test_greedy_speculative_equals_plain_past_the_sliding_window():
    """Gemma 3 270M (five local layers of window 512 to one global) with its default weights: a prompt longer
    than the window, so drafts are verified and rolled back while local layers forget their oldest keys."""
    llm = quickdraft.load("gemma3-270m", "none", device="cpu", context=2048, progress=False)
    assert llm.target.config.sliding_window == 512
    text = "Repeat the following text word for word.\n\n" + "\n\n".join(ARTICLE * 3)
    prompt = llm.target.tokenizer.encode(text)
    assert len(prompt) > 600
    params = SamplingParams(max_tokens=N, stop_at_eos=False)
    plain = [e.token for e in Engine(llm.target, 2048).generate(prompt, params) if e.token is not None]
    engine = llm.engine_for("ngram", SpeculationConfig(draft_max=8))
    events = list(engine.generate(prompt, params))
    tokens = [e.token for e in events if e.token is not None]
    assert tokens == plain, f"first difference at {_first_difference(tokens, plain)}"
    assert events[-1].stats.rounds > 0 and events[-1].stats.draft_n_accepted > 0


# ---- bench, tune, verify and doctor on the pair (until these were in a module of their own: a second load) ----

DRAFT = Draft.parse("qwen2.5-coder-0.5b")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair(llm):
    (draft,) = llm.draft_models(DRAFT)  # the one the draft fixture's drafter runs: loaded once per LLM
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
