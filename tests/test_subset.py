"""--draft-vocab: the draft model's head over part of its vocabulary (speculative/subset.py): the same logits at the
rows it keeps, drafts only from the subset as it grows with the text, and output exactly the target's."""

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.quant import vnni
from quickdraft.quant.int4 import Int4Linear
from quickdraft.quant.int8 import Int8Linear
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.subset import SubsetHead, take_rows
from quickdraft.tools.tune import Costs, reference, simulate
from quickdraft.weights.loader import load_model
from tests.helpers import PROMPT, add_noise, check_second_token_follows_the_target, save_hf_dir, tiny_hf_model

BASE = 64  # of the tiny models' 320 ids


@pytest.fixture(scope="module")
def int8_draft(tmp_path_factory):
    """The noisy draft of bf16_pair in int8 (quickdraft's kernel where the CPU has it): a quantized head to cut."""
    path = save_hf_dir(add_noise(tiny_hf_model("qwen2", seed=0, logit_scale=20)), tmp_path_factory.mktemp("d8"))
    return load_model(str(path), EngineConfig(device="cpu", dtype="bfloat16", weights="int8", max_context=256), False)


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16"])
def test_the_cut_head_gives_the_full_heads_logits_at_its_rows(kind):
    if kind != "bf16" and not vnni.available():
        pytest.skip("no VNNI kernel on this CPU: its heads cannot be cut")
    torch.manual_seed(0)
    weight = torch.randn(512, 128)
    layer = {"int4": lambda: Int4Linear(weight, None), "int8": lambda: Int8Linear(weight, None),
             "bf16": lambda: torch.nn.Linear(128, 512, bias=False, dtype=torch.bfloat16)}[kind]()
    rows = torch.tensor([8, 9, 10, 11, 400, 401, 402, 403, 40, 41, 42, 43])  # whole tiles, in any order
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        full, cut = layer(x), take_rows(layer, rows)(x)
    assert cut.shape == (3, rows.numel()) and torch.equal(cut, full[:, rows])
    assert take_rows(layer, rows) is not layer and layer(x).shape == (3, 512)  # the full head is untouched


def test_the_subset_grows_with_the_text(int8_draft):
    model = int8_draft.model
    quantized = getattr(model.output, "vnni", False)
    head = SubsetHead(model, BASE, 298)
    head.reset([5, 17, 250, 70])
    tile = 4 if quantized else 1
    expect = set(range(BASE)) | {i for t in (250, 70) for i in range(t // tile * tile, t // tile * tile + tile)}
    assert set(head.kept_ids.tolist()) == expect
    head.add([297, 3, 299])  # 297's tile reaches past the 298 shared ids, 299 is past them: never scored
    assert 297 in head.kept_ids.tolist() and max(head.kept_ids.tolist()) == 297
    x = torch.randn(1, 1, model.cfg.dim, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = head.scatter(head(x), 320)[0, 0]
        full = model.head(x)[0, 0]
    inside = torch.isfinite(logits)
    assert set(inside.nonzero()[:, 0].tolist()) == set(head.kept_ids.tolist())
    assert torch.equal(logits[inside], full[inside])
    allowed = head.allowed([5, 250], [100, 101, 7], 320)  # what the replay scores at each position of an output
    assert allowed[0, 250] and not allowed[0, 100] and allowed[1, 100] and allowed[2, 101] and allowed[2, 7]


@pytest.mark.parametrize("which", ["bf16", "int8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_with_a_cut_head_equals_plain(bf16_pair, int8_draft, which, temperature, monkeypatch):
    from quickdraft.speculative import subset

    monkeypatch.setattr(subset, "MISS_MAX", 1.0)  # the random models' answers miss often: keep the subset on
    target, draft = bf16_pair
    draft = draft if which == "bf16" else int8_draft
    params = SamplingParams(max_tokens=40, stop_at_eos=False, temperature=temperature, seed=3)
    plain = [e.token for e in Engine(target, 256).generate(PROMPT, params) if e.token is not None]
    for spec in (SpeculationConfig(draft_max=4, adaptive=False), SpeculationConfig(draft_max=8)):
        drafter = DraftModelDrafter(draft, target.config.vocab_size, 256, vocab=BASE)
        engine = Engine(target, 256, drafter, spec)
        events = list(engine.generate(PROMPT, params))
        assert [e.token for e in events if e.token is not None] == plain
        stats = events[-1].stats
        assert stats.rounds > 0 and stats.draft_n_accepted > 0
        scored = set(drafter.subset.kept_ids.tolist())
        seen = (PROMPT + plain)[:drafter.seen]  # the sequence as of the last round: its ids joined the base
        assert set(seen) <= scored | set(range(BASE))
        # with k fixed it drafts every round, so the subset has grown with the answer; the adaptive policy may stop
        # early (this draft costs what the tiny target does)
        assert len(seen) > len(PROMPT) + 10 or spec.adaptive


def test_a_cut_heads_sampled_drafts_keep_the_targets_distribution(bf16_pair, monkeypatch):
    """Rejection sampling from the cut head's distribution (zero outside the subset) still emits the target's."""
    target, draft = bf16_pair
    original = DraftModelDrafter.__init__

    def cut(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "vocab": 16})
    monkeypatch.setattr(DraftModelDrafter, "__init__", cut)
    check_second_token_follows_the_target(target, draft, draws=600)


def test_the_replay_of_a_cut_head_matches_the_engine(bf16_pair):
    target, draft = bf16_pair
    k = 3
    outputs, _ = reference(target, {"p": PROMPT}, 40)
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256, vocab=BASE),
                    SpeculationConfig(draft_max=k, adaptive=False))
    stats = list(engine.generate(PROMPT, SamplingParams(max_tokens=40, stop_at_eos=False)))[-1].stats
    replayed = DraftModelDrafter(draft, target.config.vocab_size, 256, vocab=BASE)
    sim = simulate(replayed.offers(PROMPT, outputs["p"], k), k, Costs(1.0, {i: 1.0 for i in range(1, k + 1)}, 0, 0),
                   replayed.replay_round)
    assert (sim["rounds"], sim["plain"]) == (stats.rounds, stats.plain_steps)
    assert sum(sim["kept"]) == stats.draft_n_accepted and sum(sim["tried"]) == stats.draft_n


def test_a_head_that_cannot_be_cut_says_so(bf16_pair):
    target, draft = bf16_pair
    with pytest.raises(QuickdraftError, match="draft_vocab must be 0"):
        SpeculationConfig(draft_vocab=-1)
    from quickdraft.speculative.draft import DraftBuilder, Draft

    builder = DraftBuilder(target, EngineConfig(device="cpu", dtype="bfloat16", weights="bf16"), 256)
    with pytest.raises(QuickdraftError, match="no draft model"):
        builder.drafter(Draft("ngram"), SpeculationConfig(draft_vocab=64))


def test_an_answer_that_keeps_missing_drafts_with_the_whole_head(bf16_pair):
    """Past MISS_MAX misses per answer token (after MISS_MIN of them) the drafter scores every id again, in the
    engine and in tune's replay alike."""
    from quickdraft.speculative import subset

    target, draft = bf16_pair
    head = SubsetHead(draft.model, 16, 320)
    head.reset([1, 2, 3])
    head.add(list(range(16, 16 + subset.MISS_MIN - 1)), answer=True)  # every one a miss, not yet judged
    assert head.active
    head.add([5], answer=True)
    assert not head.active and head.missed == subset.MISS_MIN - 1
    output = list(range(100, 140))
    allowed = head.allowed([1, 2, 3], output, 320)
    # output[t] is judged with the ids up to it; the miss rate trips at the MISS_MIN-th token, all ids after it
    assert not allowed[subset.MISS_MIN - 1].all() and allowed[subset.MISS_MIN:].all()
    drafter = DraftModelDrafter(draft, 320, 256, vocab=16)
    engine = Engine(target, 256, drafter, SpeculationConfig(draft_max=3, adaptive=False))
    params = SamplingParams(max_tokens=60, stop_at_eos=False)
    plain = [e.token for e in Engine(target, 256).generate(PROMPT, params) if e.token is not None]
    assert [e.token for e in engine.generate(PROMPT, params) if e.token is not None] == plain
    assert not drafter.subset.active  # 16 of 320 ids: the random model's answer misses most of the time
