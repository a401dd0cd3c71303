"""Structured output on tiny random models with a byte-level vocabulary: a random model knows nothing of
JSON, so every valid output is the mask's doing; speculation must change nothing under a constraint."""

import json
import re

import pytest
import torch

from quickdraft import constraint as masks, sampling
from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.combined import CombinedDrafter
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.tools.verify import chi_square
from tests.helpers import byte_level_pair

BF16 = EngineConfig(device="cpu", dtype="bfloat16", max_context=256)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "ok", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
REGEX = r"[a-c]{2,5}@(x|yz)\.(com|org)"
GBNF = 'root ::= "(" item (", " item)* ")"\nitem ::= [0-9] | "yes" | "no"\n'


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return byte_level_pair(tmp_path_factory.mktemp("grammar"), BF16)


def drafter(kind, target, draft):
    model = DraftModelDrafter(draft, target.config.vocab_size, 256)
    return {"draft": model, "ngram": NgramDrafter(), "combined": CombinedDrafter(NgramDrafter(), model)}[kind]


def generate(engine, spec: Grammar, params, prompt=None, **kw):
    prompt = prompt or engine.target.tokenizer.encode("answer: ")
    events = list(engine.generate(prompt, params, constraint=engine.constraint(spec), **kw))
    tokens = [e.token for e in events if e.token is not None]
    return tokens, "".join(e.text for e in events), events[-1]


def valid_schema_output(text):
    value = json.loads(text)
    return (set(value) == {"color", "ok", "n"} and value["color"] in ("red", "green", "blue")
            and isinstance(value["ok"], bool) and isinstance(value["n"], int) and 0 <= value["n"] <= 99)


def test_invalid_constraints_name_the_library_message(models):
    target, _ = models
    engine = Engine(target, 256)
    with pytest.raises(QuickdraftError, match="(?s)invalid regular expression: .*unclosed group"):
        engine.constraint(Grammar("regex", "ab("))
    with pytest.raises(QuickdraftError, match="(?s)invalid JSON schema: .*nosuch"):
        engine.constraint(Grammar("json_schema", '{"type": "nosuch"}'))
    with pytest.raises(QuickdraftError, match="not valid JSON"):
        engine.constraint(Grammar("json_schema", "{type: object}"))
    with pytest.raises(QuickdraftError, match="(?s)invalid grammar: .*undefined"):
        engine.constraint(Grammar("grammar", "root ::= undefined-rule"))
    for empty in ("root ::= ", 'root ::= ""'):  # accepted by the library, then nothing is generated
        with pytest.raises(QuickdraftError, match="matches only the empty text"):
            engine.constraint(Grammar("grammar", empty))
    with pytest.raises(QuickdraftError, match="unknown constraint kind"):
        Grammar("xml")


def test_unpack_matches_the_bits():
    words = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)
    allowed = masks.unpack(words, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2] + list(range(32, 40))
    assert allowed[1].nonzero().flatten().tolist() == []  # bit 31 of word 1 is id 63, past the vocabulary


@pytest.mark.parametrize("kind,spec,check", [
    ("draft", Grammar.json_schema(SCHEMA), valid_schema_output),
    ("combined", Grammar("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ("draft", Grammar("regex", REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    ("combined", Grammar("grammar", GBNF), lambda t: re.fullmatch(r"\(([0-9]|yes|no)(, ([0-9]|yes|no))*\)", t)),
])
def test_sampled_outputs_always_match_with_speculation(models, kind, spec, check):
    target, draft = models
    engine = Engine(target, 256, drafter(kind, target, draft), SpeculationConfig(draft_max=4, adaptive=False))
    finished = 0
    for seed in range(12):
        params = SamplingParams(temperature=1.0, max_tokens=120, seed=seed if seed % 2 else None)
        tokens, text, final = generate(engine, spec, params)
        if final.finish_reason == "length":  # an unbounded grammar may run out of tokens: never "complete"
            continue
        finished += 1
        assert final.finish_reason == "stop"
        assert check(text), text
        assert final.stats.constraint == spec.kind and final.stats.masks_computed > 0
    assert finished >= 3
    assert final.stats.rounds > 0  # speculation stayed on under the constraint


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("spec", [SpeculationConfig(draft_max=3, adaptive=False), SpeculationConfig(draft_max=8),
                                  SpeculationConfig(draft_max=4, adaptive=False, constrain_draft=False)],
                         ids=["fixed-3", "adaptive", "blind-draft"])
def test_greedy_constrained_speculation_equals_plain(models, kind, spec):
    target, draft = models
    params = SamplingParams(max_tokens=60)
    for constraint in (Grammar.json_schema(SCHEMA), Grammar("regex", REGEX)):
        plain = generate(Engine(target, 256), constraint, params)
        ours = generate(Engine(target, 256, drafter(kind, target, draft), spec), constraint, params)
        assert ours[0] == plain[0] and ours[1] == plain[1]
        assert ours[2].finish_reason == plain[2].finish_reason


@pytest.mark.parametrize("constrain_draft", [True, False])
def test_seeded_constrained_speculation_equals_plain(models, constrain_draft):
    target, draft = models
    spec = SpeculationConfig(draft_max=4, adaptive=False, constrain_draft=constrain_draft)
    for seed in range(3):
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=seed)
        plain = generate(Engine(target, 256), Grammar.json_schema(SCHEMA), params)
        ours = generate(Engine(target, 256, drafter("draft", target, draft), spec),
                        Grammar.json_schema(SCHEMA), params)
        assert ours[0] == plain[0]


def test_constrained_draft_accepts_more_than_a_blind_one(models):
    """What the mask buys the draft: its guesses inside the grammar are the target's more often."""
    target, draft = models
    rates = {}
    for constrain in (True, False):
        engine = Engine(target, 256, drafter("draft", target, draft),
                        SpeculationConfig(draft_max=4, adaptive=False, constrain_draft=constrain))
        accepted = drafted = 0
        for seed in range(4):
            _, _, final = generate(engine, Grammar.json_schema(SCHEMA),
                                   SamplingParams(temperature=1.0, max_tokens=40, seed=seed))
            accepted, drafted = accepted + final.stats.draft_n_accepted, drafted + final.stats.draft_n
        rates[constrain] = accepted / drafted
    assert rates[True] > rates[False], rates


def test_unsatisfiable_within_max_tokens_ends_with_length(models):
    target, draft = models
    engine = Engine(target, 256, drafter("draft", target, draft), SpeculationConfig(draft_max=4, adaptive=False))
    long_schema = {"type": "object", "required": ["a"], "additionalProperties": False,
                   "properties": {"a": {"type": "string", "minLength": 40}}}
    tokens, text, final = generate(engine, Grammar.json_schema(long_schema), SamplingParams(max_tokens=20))
    assert final.finish_reason == "length" and len(tokens) == 20
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_the_mask_thread_ends_with_its_engine(models):
    """Masks are computed on a thread of the engine's while the target runs: bench and tune make engine after engine,
    and each one's thread must go with it (the executor's worker ends when the executor is collected)."""
    import gc
    import threading

    def maskers():
        return {t for t in threading.enumerate() if t.name.startswith("quickdraft-mask")}

    target, draft = models
    before = maskers()
    engine = Engine(target, 256, drafter("draft", target, draft), SpeculationConfig(draft_max=4, adaptive=False))
    generate(engine, Grammar.json_schema(SCHEMA), SamplingParams(max_tokens=8))
    (mine,) = maskers() - before
    del engine
    gc.collect()
    mine.join(10)
    assert not mine.is_alive()


@pytest.mark.parametrize("constrain_draft", [True, False])
def test_constrained_sampling_follows_the_constrained_target_distribution(models, constrain_draft):
    """Rejection sampling under a mask: the second token (the first a round emits) is distributed as the
    target's masked distribution says, with the draft masked too or blind to the grammar."""
    target, draft = models
    tok = target.tokenizer
    params = SamplingParams(temperature=1.0, max_tokens=3)  # 3: room for a round after the first token
    prompt = tok.encode("pick: ")
    letters = [tok.encode(c)[0] for c in "abcd"]
    allowed = torch.zeros(1, target.config.vocab_size, dtype=torch.bool)
    allowed[0, letters] = True
    V, draws = target.config.vocab_size, 600
    exact = torch.zeros(V)
    with torch.no_grad():
        cache = KVCache.for_model(target.model, 16)
        p1 = sampling.process(masks.apply(target.model(torch.tensor([prompt]), cache, last_only=True)[0],
                                            allowed), params)[0]
        for t1 in letters:
            cache.rollback(len(prompt))
            p2 = sampling.process(masks.apply(target.model(torch.tensor([[t1]]), cache)[0], allowed), params)[0]
            exact += p1[t1] * p2
    engine = Engine(target, 16, DraftModelDrafter(draft, V, 16),
                    SpeculationConfig(draft_max=1, adaptive=False, constrain_draft=constrain_draft))
    counts = torch.zeros(V)
    torch.manual_seed(0)
    for _ in range(draws):
        tokens, _, final = generate(engine, Grammar("regex", "[a-d][a-d]"), params, prompt)
        counts[tokens[1]] += 1
    assert final.stats.rounds == 1
    assert counts[exact == 0].sum() == 0
    _, dof, p_value = chi_square(counts.double(), exact.double())
    assert dof >= 3 and p_value > 1e-3, (counts[exact > 0] / draws, exact[exact > 0])
