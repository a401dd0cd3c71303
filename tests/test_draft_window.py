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
    draft.forward = lambda tokens, cache, *a, **k: (fed.append(tokens.shape[1]), forward(tokens, cache, *a, **k))[1]
    try:
        events = list(Engine(target, 256, drafter, SpeculationConfig(draft_max=4, adaptive=False)).generate(PROMPT,
                                                                                                           params))
    finally:
        del draft.forward
    assert [e.token for e in events if e.token is not None] == plain
    assert events[-1].stats.rounds > 0 and events[-1].stats.draft_n_accepted > 0
    assert drafter.cache.capacity == SINKS + window + SLACK + MAX_DRAFT + 1
    assert drafter.dropped > 0 and max(fed) <= SINKS + window + SLACK  # the prompt's 150 tokens were never fed


def test_a_windows_bounds_are_checked():
    with pytest.raises(QuickdraftError, match="draft_window must be 0"):
        SpeculationConfig(draft_window=-1)
    from quickdraft.tools.flags import say

    with pytest.raises(QuickdraftError) as e:
        SpeculationConfig(draft_window=-1)
    assert say(e.value).startswith("--draft-window must be 0 (the whole context) or a number of tokens")
