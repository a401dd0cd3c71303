"""A draft model drafting from a window of the context (--draft-window): its first SINKS tokens and the last W of the
rest, each at its own position, so what it feeds and attends to is bounded whatever the prompt's length."""

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.speculative.draft_model import MAX_DRAFT, SINKS, SLACK, DraftModelDrafter
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(150)]  # longer than the window and its slack: it is cut


def test_a_windowed_draft_attends_to_its_sinks_and_window_at_their_own_positions(tmp_path):
    """Against transformers: the draft's logits after taking in a long prompt are those of the sinks and the window
    alone, at their own position ids (the positions between simply absent)."""
    hf = tiny_hf_model("qwen2", seed=0)
    lm = load_model(str(save_hf_dir(hf, tmp_path / "d")), F32, False)
    window = 16
    drafter = DraftModelDrafter(lm, lm.config.vocab_size, 256, window=window)
    seq = PROMPT + [11]
    drafter.begin(PROMPT, prefill=False)
    feed = drafter._sync(seq)
    ours = drafter._logits(feed)
    start = len(seq) - window
    assert drafter.dropped == start - SINKS and drafter.cache.length == SINKS + window  # (its last: fed, not cut)
    ids = seq[:SINKS] + seq[start:]
    positions = list(range(SINKS)) + list(range(start, len(seq)))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0, -1]
    torch.testing.assert_close(ours[:theirs.shape[-1]], theirs, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=80, stop_at_eos=False),
                                    SamplingParams(temperature=0.8, seed=3, max_tokens=80, stop_at_eos=False)],
                         ids=["greedy", "seeded"])
def test_speculation_from_a_window_equals_plain_and_stays_bounded(bf16_pair, params):
    """The window moves several times over the prompt and the answer (the draft's drops and compactions), and the
    output is plain decoding's; the draft's cache is its window's size, and a round never feeds it more."""
    target, draft = bf16_pair
    plain = [e.token for e in Engine(target, 256).generate(PROMPT, params) if e.token is not None]
    window = 8
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256, window=window)
    fed = []
    forward = draft.forward
    draft.forward = lambda tokens, cache, *a, **k: (fed.extend(tokens[0].tolist()), forward(tokens, cache, *a, **k))[1]
    try:
        events = list(Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False)).generate(PROMPT,
                                                                                                           params))
    finally:
        del draft.forward
    assert [e.token for e in events if e.token is not None] == plain
    assert events[-1].stats.rounds > 0 and events[-1].stats.draft_n_accepted > 0
    assert drafter.cache.capacity == SINKS + window + SLACK + MAX_DRAFT + 1
    # the prompt fed whole would feed all 150 of its tokens: its sinks and the window's are all that was
    assert drafter.dropped > 0 and len(fed) < len(PROMPT) // 2 + events[-1].stats.draft_n + 80, len(fed)
    middle = PROMPT[SINKS + window + SLACK:len(PROMPT) - window - SLACK]  # never in a window of the prompt
    assert fed[:SINKS] == PROMPT[:SINKS] and not _contains(fed, middle[:8]), fed[:40]


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def _hf_logits(hf, seq: list[int], dropped: int) -> torch.Tensor:
    """transformers' logits after the sinks and the tokens of seq past the `dropped` ones behind them, each at its own
    position: what a windowed draft holds, fed from scratch."""
    start = SINKS + dropped
    ids, positions = seq[:SINKS] + seq[start:], list(range(SINKS)) + list(range(start, len(seq)))
    with torch.no_grad():
        return hf(torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0, -1]


def test_both_ways_the_window_moves_give_what_feeding_it_afresh_gives(tmp_path):
    """The window moves forward in two ways (DraftModelDrafter._sync): where the draft holds the window's beginning
    (it drafted all along), what it holds of it is moved behind the sinks (a compaction of keys and values); where it
    holds none of it (it sat out many steps), it is fed from the window's beginning. Each gives the logits of the sinks
    and the window fed from scratch at their own positions (transformers, position ids given)."""
    hf = tiny_hf_model("qwen2", seed=0)
    lm = load_model(str(save_hf_dir(hf, tmp_path / "d")), F32, False)
    window = 16
    seq = PROMPT + [(5 * i + 1) % 300 + 5 for i in range(30)]
    held = DraftModelDrafter(lm, lm.config.vocab_size, 256, window=window)  # decodes along: holds the window
    whole = DraftModelDrafter(lm, lm.config.vocab_size, 256)  # its twin without a window, fed the same from 84 on
    held.begin(seq[:100], prefill=False)
    moves = []
    for end in range(100, len(seq) + 1):
        before = held.dropped
        ours = held._logits(held._sync(seq[:end]))
        if before == 0:  # the first cut: fed from the window's beginning, as afresh
            torch.testing.assert_close(ours[:320], _hf_logits(hf, seq[:end], held.dropped), atol=2e-4, rtol=2e-4)
            whole._logits(seq[:SINKS])  # (its twin: the same rows at the same positions, then never cut)
            whole.cache.offset = held.dropped
            whole._logits(seq[SINKS + held.dropped:end])
        else:
            whole._logits(seq[end - 1:end])
        if held.dropped != before:
            moves.append((end, held.dropped))
    assert [m for m, _ in moves] == [100, 165]  # the first cut, then a compaction (the window outgrew its slack)
    # what the compaction kept: the sinks' and the window's keys and values, bit for bit as written before it; and
    # the tokens fed after it at their own positions (the first layer's keys and values, which depend on nothing else)
    (at, dropped), cut = moves[1], moves[1][1] - moves[0][1]
    for i, (kept, written) in enumerate(zip(held.cache.tensors(), whole.cache.tensors())):
        rows = held.cache.length if i < 2 else at - 1 - dropped
        assert torch.equal(kept[:, :, :SINKS], written[:, :, :SINKS])
        assert torch.equal(kept[:, :, SINKS:rows], written[:, :, SINKS + cut:cut + rows])
    far = DraftModelDrafter(lm, lm.config.vocab_size, 256, window=window)  # holds the sinks alone
    far.begin(seq[:10], prefill=False)
    far._logits(far._sync(seq[:10]))
    ours = far._logits(far._sync(seq))
    assert far.dropped == len(seq) - window - SINKS
    torch.testing.assert_close(ours[:320], _hf_logits(hf, seq, far.dropped), atol=2e-4, rtol=2e-4)


def test_the_memory_plan_counts_the_window_the_user_set(tmp_path):
    """The draft's cache as planned is its window's (the sinks, W, its slack and a round's drafts), the default's or
    the one asked for; 0, the whole context."""
    from quickdraft.api import memory_plan
    from quickdraft.speculative.draft import Draft
    from quickdraft.weights import memory

    path = str(save_hf_dir(tiny_hf_model("qwen2"), tmp_path / "m"))
    config = EngineConfig(device="cpu", dtype="bfloat16", max_context=4096)
    cfg = memory.spec_from_source("draft", path, "bf16").cfg

    def planned(window):
        plan = memory_plan(path, Draft.parse(path), config, window=window)
        return next(i.nbytes for i in plan.items if i.what == "draft KV cache")

    assert planned(64) == memory.kv_bytes(cfg, SINKS + 64 + SLACK + MAX_DRAFT + 1)
    assert planned(0) == memory.kv_bytes(cfg, 4096)
    assert planned(None) == memory.kv_bytes(cfg, SINKS + 1024 + SLACK + MAX_DRAFT + 1)  # the CPU's default


def test_a_windows_bounds_are_checked():
    with pytest.raises(QuickdraftError, match="draft_window must be 0"):
        SpeculationConfig(draft_window=-1)
    from quickdraft.tools.flags import say

    with pytest.raises(QuickdraftError) as e:
        SpeculationConfig(draft_window=-1)
    assert say(e.value).startswith("--draft-window must be 0 (the whole context) or a number of tokens")


def _windowed(target, draft, window=8):
    return DraftModelDrafter(draft, target.config.vocab_size, 256, window=window)


def test_a_window_with_prefix_reuse_and_in_a_batch_gives_each_answer_alone(bf16_pair):
    """A windowed draft over a conversation's kept prefix (each turn's prompt longer than the window), and several
    sequences drafting from their windows in one batched pass over their compacted caches: each answer is plain
    decoding's, greedy and seeded."""
    from quickdraft.engine import Batch
    from tests import test_prefix_reuse

    target, draft = bf16_pair
    fixed = SpeculationConfig(draft_max=4, adaptive=False)
    for params in (test_prefix_reuse.GREEDY, test_prefix_reuse.SEEDED):
        cold, _ = test_prefix_reuse.conversation(Engine(target, 256), params, reuse=False)
        drafter = _windowed(target, draft)
        warm, reused = test_prefix_reuse.conversation(Engine(target, 256, drafter, fixed, slots=2), params)
        assert warm == cold and all(n > 0 for n in reused[1:]) and drafter.dropped > 0, reused
    prompts = [PROMPT, PROMPT[40:] + PROMPT[:40], PROMPT[::-1]]
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    want = [[e.token for e in Engine(target, 256).generate(p, params) if e.token is not None] for p in prompts]
    engine = Engine(target, 256, _windowed(target, draft), fixed, slots=4)
    batch, got = Batch(engine, 3), {}
    seqs = [batch.add(p, params) for p in prompts]
    while batch.active:
        batch.step(lambda s, e: got.setdefault(id(s), []).append(e.token))
    assert [[t for t in got[id(s)] if t is not None] for s in seqs] == want
    assert all(s.slot.drafter.dropped > 0 and s.stats.rounds > 0 for s in seqs)


def test_a_probe_after_the_window_was_cut_drafts_from_its_window_and_keeps_the_output(bf16_pair, monkeypatch):
    """Plain steps with a probe now and then (the policy's answer here: 2 drafts every 20th step), the draft's window
    cut meanwhile: each probe feeds at most the probe window (draft_model.PROBE_WINDOW) and the output is plain
    decoding's."""
    from quickdraft.speculative.draft_model import PROBE_WINDOW

    target, draft = bf16_pair
    params = SamplingParams(max_tokens=90, stop_at_eos=False)
    plain = [e.token for e in Engine(target, 256).generate(PROMPT, params) if e.token is not None]
    drafter = _windowed(target, draft, window=16)
    engine = Engine(target, 256, drafter, SpeculationConfig(draft_max=4))
    asked = []

    def k_for(source, *args, **kwargs):
        asked.append(source)
        return 2 if len(asked) % 20 == 0 else 0
    monkeypatch.setattr(engine.policy, "k_for", k_for)
    fed = []
    forward = draft.forward
    draft.forward = lambda tokens, cache, *a, **k: (fed.append(tokens.shape[1]), forward(tokens, cache, *a, **k))[1]
    try:
        events = list(engine.generate(PROMPT, params))
    finally:
        del draft.forward
    assert [e.token for e in events if e.token is not None] == plain
    assert events[-1].stats.rounds >= 3 and drafter.dropped > 0
    assert max(fed) <= PROBE_WINDOW  # (its first round's catch-up too: a probe's window of the prompt)
