"""On the real default pair: greedy speculative output equals plain greedy output, token for token."""

from pathlib import Path

import pytest

from quickdraft.config import EngineConfig, SamplingParams, SpecConfig
from quickdraft.engine import Engine
from quickdraft.spec.build import build_drafter
from quickdraft.weights.loader import load_model

pytestmark = pytest.mark.slow

ARTICLE = (Path(__file__).parent / "data" / "ppl.txt").read_text(encoding="utf-8").split("\n\n")[:2]
PROMPTS = {
    "code": "Write a Python class for a least-recently-used cache with get and put methods, with comments.",
    "chinese": "请用中文详细解释快速排序算法的原理，并分析它的时间复杂度。",
    "summary": "Summarize the following text in a few sentences, reusing its wording:\n\n" + "\n\n".join(ARTICLE),
}
N = 128
CONFIG = EngineConfig(device="cpu", dtype="bfloat16", max_context=1024)


@pytest.fixture(scope="module")
def target():
    return load_model("qwen2.5-coder-1.5b", CONFIG, progress=False)


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
    return [e.token for e in events if e.token is not None], events[-1].spec


@pytest.mark.parametrize("draft, ngram", [("qwen2.5-coder-0.5b", False), ("ngram", False),
                                          ("qwen2.5-coder-0.5b", True)], ids=["draft-model", "ngram", "combined"])
def test_greedy_speculative_equals_plain_on_real_pair(target, prompts, plain, draft, ngram):
    spec = SpecConfig(draft_max=8)
    drafter = build_drafter(draft, target, CONFIG, spec, 1024, ngram=ngram, progress=False)
    engine = Engine(target, 1024, drafter, spec)
    for name, prompt in prompts.items():
        tokens, stats = _tokens(engine, prompt)
        expected, _ = plain[name]
        assert len(tokens) == N
        assert tokens == expected, f"{name}: first difference at {_first_difference(tokens, expected)}"
        assert stats.rounds > 0 and stats.draft_n_accepted > 0, name


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
