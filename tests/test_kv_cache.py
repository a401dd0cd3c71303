"""Rollback is a pointer move, and rewriting after a rollback equals never having gone further."""

import torch

from quickdraft.config import EngineConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model


def tiny(tmp_path):
    save_hf_dir(tiny_hf_model("qwen2"), tmp_path)
    return load_model(str(tmp_path), EngineConfig(device="cpu", dtype="float32", max_context=64), progress=False)


def test_rollback_then_rewrite_equals_straight_decoding(tmp_path):
    lm = tiny(tmp_path)
    straight = KVCache.for_model(lm.model)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():  # the same chunks with and without the detour, so row counts match
        lm.model(tokens[:, :5], straight)
        want = lm.model(tokens[:, 5:], straight)
        spec = KVCache.for_model(lm.model)
        lm.model(tokens[:, :5], spec)
        lm.model(torch.tensor([[7, 7, 7]]), spec)  # a rejected continuation
        spec.rollback(5)
        assert spec.length == 5
        got = lm.model(tokens[:, 5:], spec)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    n = straight.length
    assert spec.length == n
    for got_layer, want_layer in zip(spec.k + spec.v, straight.k + straight.v):
        torch.testing.assert_close(got_layer[:, :, :n], want_layer[:, :, :n], rtol=0, atol=0)


def test_cache_is_preallocated_and_written_in_place():
    cache = KVCache([(1, 4, 0), (1, 4, 1)], 16)  # two layers of one key/value head of 4
    k_storage = cache.k[0].data_ptr()
    keys, _ = cache.write(0, torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
    assert keys.shape == (1, 1, 3, 4) and cache.k[0].data_ptr() == k_storage


def test_a_budget_counts_what_a_slot_holds_once_and_drops_the_least_recently_used():
    """Slots under a byte budget (serve --cache-ram on the CPU): a slot taken for a new prompt no longer than what it
    held takes no more memory, so no other conversation is dropped for it (it was counted twice); one that grows past
    the budget drops the least recently used idle conversation, never a running one."""
    from quickdraft.runtime.slots import Slot, Slots

    def make():
        return Slot(KVCache([(1, 4, 0), (1, 4, 1)], 256), None)

    per = make().cache.position_bytes()
    slots = Slots(make, 2, budget=250 * per)

    def run(prompt):  # a generation: the prompt's keys and values written, the slot released
        slot, _ = slots.take(prompt)
        slot.cache.length, slot.tokens, slot.busy = len(prompt), list(prompt), False
        return slot

    a, b = run(list(range(100))), run(list(range(1000, 1100)))
    assert slots.used_bytes() == 200 * per
    c = run(list(range(2000, 2100)))  # a third conversation in a's slot: as many positions as a held
    assert c is a and b.tokens and slots.dropped == 0
    d = run(list(range(3000, 3200)))  # b's slot, 100 positions more: over the budget, so c (idle) is dropped
    assert d is b and not c.tokens and slots.dropped == 1 and slots.used_bytes() <= 250 * per


def test_a_running_conversation_growing_past_the_budget_drops_an_idle_one():
    """A running sequence's cache grows as it generates (beyond the prompt its slot was taken for): once a step takes
    the slots past the budget, the least recently used idle conversation is dropped (Slots.fit, after every engine
    step), never the running one; within the budget nothing is."""
    from quickdraft.runtime.slots import Slot, Slots

    def make():
        return Slot(KVCache([(1, 4, 0), (1, 4, 1)], 256), None)

    per = make().cache.position_bytes()
    slots = Slots(make, 2, budget=250 * per)
    a, _ = slots.take(list(range(100)))
    a.cache.length, a.tokens, a.busy = 100, list(range(100)), False
    b, _ = slots.take(list(range(1000, 1100)))  # running: its prompt's 100 positions, then 40 generated
    b.cache.length = 140
    slots.fit()
    assert a.tokens and slots.dropped == 0  # 240 positions: within the budget
    b.cache.length = 180
    slots.fit()
    assert not a.tokens and b.busy and slots.dropped == 1 and slots.used_bytes() == 180 * per
