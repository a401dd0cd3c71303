"""Prefix reuse (runtime/slots.py): a prompt that begins with what a kept slot holds prefills only the rest, and the
output is the one an empty cache gives, token for token (greedy and seeded), on every family (sliding windows,
soft caps, shared keys and values, hybrids' recurrent states, mixtures of experts) and with each drafter."""

import sys

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime import slots as slots_mod
from quickdraft.api import memory_plan
from quickdraft.speculative.combined import CombinedDrafter
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.weights.loader import load_model
from tests.helpers import add_noise, save_hf_dir, tiny_hf_model

BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
GREEDY = SamplingParams(max_tokens=20, stop_at_eos=False)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, stop_at_eos=False)
SPEC = SpeculationConfig(draft_max=4, adaptive=False)
# a long system prompt (two prefill chunks), then user turns
SYSTEM = [(7 * i + 3) % 300 + 10 for i in range(90)]
TURNS = [[11, 12, 13, 14, 15], [21, 22, 23, 24], [31, 32, 33]]


def build(name: str, path):
    from tests.families import save, tiny_model
    from tests.test_hybrid import tiny_qwen35
    from tests.test_moe import tiny_moe

    if name == "qwen3_5":
        return save_hf_dir(tiny_qwen35(logit_scale=20), path)
    if name == "qwen3_5_moe":
        return save_hf_dir(tiny_moe(name, logit_scale=20), path)
    return save(tiny_model(name), path)


def generate(engine, prompt, params, reuse=True, rounds=None):
    """The answer's tokens and timings; rounds: a list given gets the speculative rounds it verified."""
    events = list(engine.generate(prompt, params, reuse=reuse))
    if rounds is not None:
        rounds.append(events[-1].stats.rounds)
    return [e.token for e in events if e.token is not None], events[-1].timings


def conversation(engine, params, reuse=True, rounds=None):
    """Three turns, each prompt the whole history (the last answer included) and a new user turn, as a chat client
    sends it: (the answers, how many prompt tokens each turn reused); rounds: as generate's, per turn."""
    history, answers, reused = list(SYSTEM), [], []
    for turn in TURNS:
        prompt = history + turn
        tokens, timings = generate(engine, prompt, params, reuse, rounds)
        answers.append(tokens)
        reused.append(timings.cache_n)
        history = prompt + tokens
    return answers, reused


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "gemma2", "gemma3", "gemma4", "phi3", "qwen3_5",
                                  "qwen3_5_moe"])
def test_a_reused_prefix_gives_what_an_empty_cache_gives(tmp_path, name):
    lm = load_model(str(build(name, tmp_path / name)), BF16, False)
    for params in (GREEDY, SEEDED):
        cold, none_reused = conversation(Engine(lm, 256), params, reuse=False)
        warm, reused = conversation(Engine(lm, 256), params)
        assert warm == cold, (name, params.seed)
        assert none_reused == [0, 0, 0] and reused[0] == 0
        # every later turn took the earlier ones from the slot (a hybrid: from the checkpoint where the turn ended)
        assert all(n >= len(SYSTEM) for n in reused[1:]), reused


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse-pair")
    target = load_model(str(save_hf_dir(tiny_hf_model("qwen2", seed=0, logit_scale=20), root / "t")), BF16, False)
    draft_hf = add_noise(tiny_hf_model("qwen2", seed=0, logit_scale=20))
    return target, load_model(str(save_hf_dir(draft_hf, root / "d")), BF16, False)


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
def test_speculation_over_a_reused_prefix_gives_plain_decodings_output(pair, kind):
    """Each drafter keeps what it holds of the conversation in its slot (a draft model's cache); greedy and seeded
    output over a reused prefix equals plain decoding from an empty cache."""
    target, draft = pair

    def drafter():
        model = DraftModelDrafter(draft, target.config.vocab_size, 256)
        return {"draft": model, "ngram": NgramDrafter(), "combined": CombinedDrafter(NgramDrafter(), model)}[kind]

    for params in (GREEDY, SEEDED):
        plain, _ = conversation(Engine(target, 256), params, reuse=False)
        engine, rounds = Engine(target, 256, drafter(), SPEC, slots=2), []
        ours, reused = conversation(engine, params, rounds=rounds)
        assert ours == plain and all(n > len(SYSTEM) for n in reused[1:]), (kind, reused)
        assert all(rounds[1:]) or (kind, params) == ("ngram", SEEDED), rounds  # drafted over each reused prefix


def test_a_hybrid_prefix_that_falls_between_checkpoints_restarts_from_the_last_before_it(tmp_path):
    """A recurrent state returns only to the positions it keeps or to a checkpoint (the end of each prefill and of
    each generation). A prompt that changes a token inside the last answer leaves the slot between them: the prompt
    is taken from the checkpoint at the end of that turn's prompt, and the output is still a cold start's."""
    lm = load_model(str(build("qwen3_5", tmp_path / "h")), BF16, False)
    engine = Engine(lm, 256)
    first = SYSTEM + TURNS[0]
    answer, _ = generate(engine, first, GREEDY)
    assert sorted(engine.last.checkpoints) == [len(first), len(first) + len(answer) - 1]
    # the answer's second token changed: before the positions the state keeps (its last HISTORY), after a checkpoint
    edited = first + answer[:1] + [(answer[1] + 1) % 300] + answer[2:] + TURNS[1]
    ours, timings = generate(engine, edited, GREEDY)
    assert timings.cache_n == len(first)  # the checkpoint before the edit
    assert ours == generate(Engine(lm, 256), edited, GREEDY, reuse=False)[0]


def test_slots_keep_several_conversations_and_reuse_the_least_recently_used(pair):
    target, _ = pair
    engine = Engine(target, 256, slots=2)
    a, b, c = (SYSTEM[:40] + [i] * 30 for i in (1, 2, 3))  # three conversations, no prefix in common beyond 40
    for prompt in (a, b):
        generate(engine, prompt, GREEDY)
    _, t = generate(engine, a + [5, 6], GREEDY)  # a's slot, kept: its whole prompt is reused
    assert t.cache_n == len(a)
    _, t = generate(engine, c, GREEDY)  # a third conversation takes the slot used least recently: b's
    assert t.cache_n == 40  # (it shares the first 40 tokens with b: copied, not recomputed)
    _, t = generate(engine, b + [5, 6], GREEDY)
    assert t.cache_n == 40, "b's slot went to c; only the shared beginning is left"
    assert len(engine.slots.slots) == 2


def test_a_prompt_sent_again_takes_its_own_slot_and_leaves_the_others(pair):
    """A client sending the same prompt again (a retry, a regenerate, the same question from several agents) reuses
    its slot, and does not copy its beginning over another conversation's slot (it once did: the prompt less its last
    token looked like another conversation)."""
    target, _ = pair
    engine = Engine(target, 256, slots=3)
    a, b, c = (SYSTEM[:40] + [i] * 30 for i in (1, 2, 3))
    for prompt in (a, b, c):
        generate(engine, prompt, GREEDY)
    for prompt in (a, b, c, b, a):
        assert generate(engine, prompt, GREEDY)[1].cache_n == len(prompt) - 1


def test_a_slot_a_waiting_request_would_reuse_is_left_to_it(pair):
    """Requests arriving together: a new conversation taking a slot leaves alone the one a request still waiting
    would reuse, and takes the least recently used of the others."""
    target, _ = pair
    engine = Engine(target, 256, slots=2)
    a, b, c = (SYSTEM[:40] + [i] * 30 for i in (1, 2, 3))
    for prompt in (a, b):
        generate(engine, prompt, GREEDY)
    slot_of = {id(engine.slots._best(p, engine.slots.slots)): name for name, p in (("a", a), ("b", b))}
    slot, n = engine.slots.take(c, wanted=[a + [5, 6]])  # a's slot is the least recently used: a waits for it
    assert n == 40 and slot_of[id(slot)] == "b"
    slot.busy = False
    slot, _ = engine.slots.take(a + [5, 6])
    assert slot_of[id(slot)] == "a" and slot.reusable(a + [5, 6]) == len(a)


def test_a_second_conversation_under_the_same_system_prompt_copies_it_rather_than_cut_the_first(pair):
    """An agent's sub-agent, or a second chat, begins with the same system prompt: the common prefix is copied into
    another slot, and the first conversation keeps its whole history for its next turn."""
    target, _ = pair
    engine, cold = Engine(target, 256, slots=2), Engine(target, 256)
    first = SYSTEM + TURNS[0]
    answer, _ = generate(engine, first, GREEDY)
    second, t = generate(engine, SYSTEM + TURNS[1], GREEDY)
    assert t.cache_n == len(SYSTEM)
    assert second == generate(cold, SYSTEM + TURNS[1], GREEDY, reuse=False)[0]  # the copy gives a cold start's answer
    third, t = generate(engine, first + answer + TURNS[2], GREEDY)
    assert t.cache_n >= len(first) + len(answer) - 1
    assert third == generate(cold, first + answer + TURNS[2], GREEDY, reuse=False)[0]
    one = Engine(target, 256, slots=1)  # with a single slot the second conversation takes it over
    generate(one, first, GREEDY)
    generate(one, SYSTEM + TURNS[1], GREEDY)
    assert generate(one, first + answer + TURNS[2], GREEDY)[1].cache_n == len(SYSTEM)


def test_reuse_off_prefills_the_whole_prompt(pair):
    target, _ = pair
    engine = Engine(target, 256)
    generate(engine, SYSTEM, GREEDY)
    assert generate(engine, SYSTEM + [5], GREEDY, reuse=False)[1].cache_n == 0
    assert generate(engine, SYSTEM + [5, 6], GREEDY)[1].cache_n == len(SYSTEM) + 1


def test_a_generation_that_fails_leaves_nothing_to_reuse(pair, monkeypatch):
    """A pass that stopped half way leaves the cache unknown: the slot is forgotten, not reused."""
    target, draft = pair
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256)
    engine = Engine(target, 256, drafter, SPEC)
    generate(engine, SYSTEM, GREEDY)

    def broken(*args, **kwargs):
        raise RuntimeError("a drafter bug")

    monkeypatch.setattr(drafter, "propose_steps", broken)  # (the round's drafting: engine/round.py)
    with pytest.raises(RuntimeError, match="a drafter bug"):
        generate(engine, SYSTEM + [5, 6], GREEDY)
    assert engine.last.tokens == [] and engine.cache.length == 0


def test_the_memory_plan_counts_every_kept_sequence(tmp_path):
    from quickdraft.speculative.draft import Draft

    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path / "m"))
    config = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
    one, four = (memory_plan(path, Draft.parse(path), config, slots=n) for n in (1, 4))
    kv = {i.what: i.nbytes for i in one.items if "KV cache" in i.what}
    assert kv and all(i.nbytes == 4 * kv[i.what] for i in four.items if "KV cache" in i.what)
    assert four.used - one.used == 3 * sum(kv.values())


def test_conversations_a_slot_gives_up_return_from_host_memory_and_a_damaged_copy_is_prefilled(pair):
    """A GPU's slots give the conversations they leave to host memory (slots.HostCopies; forced here on the CPU). Two
    conversations through one slot, with a draft model (which takes in a restored prompt as a new one): each one's
    second turn takes its first back from its copy, with the output an empty cache gives. A copy damaged in memory
    fails its checksum and is prefilled, with that output again. A budget with room for one copy gives it back all the
    same (the slot's own copy does not push it out); one too small for a copy keeps none."""
    target, draft = pair

    def engine(budget):
        e = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256), SPEC, slots=1)
        e.slots.host = slots_mod.HostCopies(budget)
        return e, e.slots.host

    a, b = (SYSTEM[:40] + [i] * 30 for i in (1, 2))  # two conversations, 40 tokens in common

    def second(prompt, answer):
        return prompt + answer + [5, 6]

    cold = {p: generate(Engine(target, 256), list(p), GREEDY, reuse=False)[0] for p in map(tuple, (a, b))}
    ours, host = engine(2**30)
    for prompt in (a, b):
        assert generate(ours, prompt, GREEDY)[0] == cold[tuple(prompt)]
    assert host.stored == 1 and len(host.copies) == 1  # a's, cut by b
    got, t = generate(ours, second(a, cold[tuple(a)]), GREEDY)
    assert t.cache_n >= len(a) and host.restored == 1, t.cache_n  # its turn taken back (b's copied out)
    assert got == generate(Engine(target, 256), second(a, cold[tuple(a)]), GREEDY, reuse=False)[0]

    copy = next(c for c in host.copies if c.tokens[:len(b)] == b)
    with torch.inference_mode():  # memory gone bad
        for t in copy.tensors:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(0)) * 4)
    got, t = generate(ours, second(b, cold[tuple(b)]), GREEDY)
    assert host.damaged == 1 and t.cache_n == 40, t.cache_n  # dropped, not read: only what a's copy shares with b
    assert got == generate(Engine(target, 256), second(b, cold[tuple(b)]), GREEDY, reuse=False)[0]

    room_for_one, host = engine(copy.nbytes() * 3 // 2)  # giving b up leaves no room for a's copy beside it
    for prompt in (a, b):
        generate(room_for_one, prompt, GREEDY)
    got, t = generate(room_for_one, second(a, cold[tuple(a)]), GREEDY)
    assert host.restored == 1 and t.cache_n >= len(a) and [c.tokens[:len(b)] for c in host.copies] == [b]
    assert got == generate(Engine(target, 256), second(a, cold[tuple(a)]), GREEDY, reuse=False)[0]

    small, host = engine(1)
    for prompt in (a, b):
        generate(small, prompt, GREEDY)
    _, t = generate(small, second(a, cold[tuple(a)]), GREEDY)
    assert host.dropped == 2 and not host.copies and t.cache_n == 40  # a, then b: only their beginning is left


def test_the_common_prefix(pair):
    assert slots_mod.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert slots_mod.common_prefix([], [1]) == 0 and slots_mod.common_prefix([1, 2], [1, 2, 3]) == 2
    long = list(range(5000))  # by halving: every length of agreement, at either end
    for n in (0, 1, 2, 63, 64, 2499, 4999):
        assert slots_mod.common_prefix(long, long[:n] + [-1] + long[n + 1:]) == n
    target, _ = pair
    engine = Engine(target, 256)
    generate(engine, SYSTEM, GREEDY)
    # the whole prompt held: the last token is still run (its logits give the first new token)
    assert generate(engine, SYSTEM, GREEDY)[1].cache_n == len(SYSTEM) - 1
    assert torch.equal(torch.tensor(engine.last.tokens[:len(SYSTEM)]), torch.tensor(SYSTEM))


@pytest.mark.parametrize("kind", ["mtp", "assistant"])
def test_drafters_built_into_models_draft_over_a_reused_prefix_as_from_an_empty_cache(tmp_path, kind):
    """The MTP block keeps its cache's pairs for the prefix (the target's hidden states there are the slot's);
    Gemma 4's assistant reads the slot's keys, values and hidden states: output equal to plain decoding's."""
    from quickdraft.speculative.draft import Draft, DraftBuilder
    from tests.families import save, tiny_model
    from tests.test_assistant import tiny_assistant
    from tests.test_hybrid import tiny_qwen35, with_mtp

    if kind == "mtp":
        lm = load_model(str(with_mtp(tiny_qwen35(logit_scale=20), tmp_path / "t")), BF16, False)
        drafter = DraftBuilder(lm, BF16, 256).drafter(Draft.parse("mtp"), SPEC)
    else:
        hf = tiny_model("gemma4")
        lm = load_model(str(save(hf, tmp_path / "t")), BF16, False)
        tiny_assistant(hf.config, True).save_pretrained(tmp_path / "a")
        drafter = DraftBuilder(lm, BF16, 256).drafter(Draft.parse(str(tmp_path / "a")), SPEC)
    for params in (GREEDY, SEEDED):
        plain, _ = conversation(Engine(lm, 256), params, reuse=False)
        ours, reused = conversation(Engine(lm, 256, drafter, SPEC, slots=2), params)
        assert ours == plain and all(n >= len(SYSTEM) for n in reused[1:]), (kind, reused)


def test_a_next_turn_whose_last_answer_comes_back_otherwise_stays_in_its_slot(pair):
    """A client may send the last answer back tokenized otherwise than it was generated (its text re-encoded, a
    special token kept as text): the next turn still continues in its slot (no copy into another), from the end of
    the last prompt."""
    target, draft = pair
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256), SPEC, slots=2)
    first = SYSTEM + TURNS[0]
    answer, _ = generate(engine, first, GREEDY)
    resent = first + [(answer[0] + 1) % 300] + answer[1:] + TURNS[1]
    _, t = generate(engine, resent, GREEDY)
    assert t.cache_n == len(first) and len(engine.slots.slots) == 1


def test_a_copied_prefix_brings_the_drafts_share_along(pair):
    target, draft = pair
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256), SPEC, slots=2)
    generate(engine, SYSTEM + TURNS[0], GREEDY)
    source = engine.last
    copy = engine.slots._free({source})
    assert copy.copy_prefix(source, len(SYSTEM))
    assert copy.tokens == SYSTEM and copy.cache.length == len(SYSTEM)
    assert copy.drafter is not source.drafter and copy.drafter.tokens == SYSTEM
    assert copy.drafter.cache.length == len(SYSTEM)
    for mine, theirs in zip(copy.drafter.cache.tensors(), source.drafter.cache.tensors()):
        assert torch.equal(mine[:, :, :len(SYSTEM)], theirs[:, :, :len(SYSTEM)])


def test_a_slot_that_forgets_takes_its_drafts_share_along(pair):
    """A slot forgets (a new conversation, a pass stopped half way): its drafter holds nothing of it after."""
    target, draft = pair
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256), SPEC)
    generate(engine, SYSTEM + TURNS[0], GREEDY)
    assert engine.last.drafter.cache.length > 0
    engine.last.forget()
    assert engine.last.drafter.cache.length == 0 and engine.last.drafter.tokens == []


def test_a_finished_request_gives_the_heap_back(pair, monkeypatch):
    """Each request's end trims the heap (runtime/heap.py: glibc otherwise keeps what passes freed, and a server's
    memory grows past --cache-ram); on Linux the trim reaches glibc."""
    from quickdraft.runtime import heap

    target, _ = pair
    trims = []
    real = heap.trim
    monkeypatch.setattr(heap, "trim", lambda: trims.append(real()) or trims[-1])
    engine = Engine(target, 256)
    for prompt in ([1, 2, 3, 4], [5, 6, 7]):
        list(engine.generate(prompt, SamplingParams(max_tokens=4, stop_at_eos=False)))
    assert len(trims) == 2
    if sys.platform.startswith("linux"):
        assert heap._c(), "glibc's malloc_trim not found"


def test_kept_conversations_stay_within_the_budget_while_a_request_generates(pair):
    """serve --cache-ram on the CPU: a slot is taken for its prompt, and the positions its request then generates are
    counted as they come (Engine.step ends with Slots.fit): an idle conversation is dropped once they take the slots
    past the budget, and the answer is the one a cold engine gives."""
    target, _ = pair
    engine = Engine(target, 256, slots=2)
    per = engine.cache.position_bytes()
    engine.slots.count, engine.slots.budget = 2, 150 * per
    first = list(SYSTEM[:60])
    generate(engine, first, GREEDY)  # 80 positions kept, idle
    long = SamplingParams(max_tokens=80, stop_at_eos=False)
    peak = []
    prompt = [(5 * i + 1) % 300 + 10 for i in range(30)]
    events = []
    for event in engine.generate(prompt, long, reuse=False):
        events.append(event)
        peak.append(engine.slots.used_bytes())
    assert engine.slots.dropped == 1 and max(peak) <= engine.slots.budget + 64 * per  # (a step's positions at most)
    assert engine.slots.used_bytes() <= engine.slots.budget
    got = [e.token for e in events if e.token is not None]
    assert got == generate(Engine(target, 256), prompt, long, reuse=False)[0]


def test_a_slot_dropped_during_a_step_serves_the_next_request(pair):
    """A conversation dropped for the budget in the middle of a batched step (Slots.fit, under inference mode) gets
    fresh cache tensors; the next request starts in that slot outside inference mode (Batch.add), as the server's
    worker runs it, and writes into them: ordinary tensors, not inference ones, and the answer a cold engine gives."""
    from quickdraft.engine import Batch

    target, draft = pair
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256), SPEC, slots=3)
    per = engine.cache.position_bytes()
    engine.slots.count, engine.slots.budget = 3, 150 * per
    batch = Batch(engine, 2)
    first, second = list(SYSTEM[:60]), [(5 * i + 1) % 300 + 10 for i in range(30)]
    later = first[:40] + [7] * 20  # shares a beginning with the dropped conversation's slot
    batch.run([{"prompt": first, "params": GREEDY}])
    batch.run([{"prompt": second, "params": SamplingParams(max_tokens=80, stop_at_eos=False)}])
    assert engine.slots.dropped >= 1
    assert all(not t.is_inference() for s in engine.slots.slots for t in s.cache.k + s.cache.v)
    (events,) = batch.run([{"prompt": later, "params": GREEDY}])
    assert [e.token for e in events if e.token is not None] == generate(Engine(target, 256), later, GREEDY,
                                                                       reuse=False)[0]
