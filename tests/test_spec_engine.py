"""Speculative decoding through the engine, on tiny random models (bf16 on the CPU: batch-invariant kernels)."""

import pytest
import torch

from quickdraft import sampling
from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine, Halt
from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.vocab import check_compatible
from quickdraft.tools.verify import chi_square
from quickdraft.weights.loader import load_model
from tests.helpers import PROMPT, drafter, save_hf_dir, tiny_hf_model, tokens_of as run

BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)  # the n-gram cases need its repeats


@pytest.fixture
def models(bf16_pair):
    return bf16_pair


SPECS = {"fixed-1": SpeculationConfig(draft_max=1, adaptive=False), "fixed-3": SpeculationConfig(draft_max=3, adaptive=False),
         "fixed-8": SpeculationConfig(draft_max=8, adaptive=False), "adaptive": SpeculationConfig(draft_max=8)}


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_speculative_equals_plain(models, kind, spec):
    target, draft = models
    params = SamplingParams(max_tokens=48, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    ours, final = run(Engine(target, 256, drafter(kind, target, draft), SPECS[spec]), params)
    assert ours == plain
    stats = final.stats
    assert stats.rounds > 0 and stats.draft_n > 0
    assert 0 < stats.draft_n_accepted < stats.draft_n or kind == "ngram"


def test_greedy_with_repetition_penalty_equals_plain(models):
    target, draft = models
    params = SamplingParams(max_tokens=40, stop_at_eos=False, repetition_penalty=1.3, repetition_window=8)
    plain, _ = run(Engine(target, 256), params)
    ours, _ = run(Engine(target, 256, drafter("combined", target, draft), SPECS["fixed-3"]), params)
    assert ours == plain


def test_greedy_with_presence_and_frequency_penalties_equals_plain(models):
    target, draft = models
    params = SamplingParams(max_tokens=40, stop_at_eos=False, presence_penalty=1.5, frequency_penalty=0.5)
    plain, _ = run(Engine(target, 256), params)
    ours, final = run(Engine(target, 256, drafter("combined", target, draft), SPECS["fixed-3"]), params)
    assert ours == plain and final.stats.rounds > 0


def test_per_generation_spec_overrides_the_engine(models):
    target, draft = models
    params = SamplingParams(max_tokens=32, stop_at_eos=False)
    engine = Engine(target, 256, drafter("draft", target, draft), SPECS["adaptive"])
    plain, off = run_with(engine, params, SpeculationConfig(draft_max=0))
    assert off.stats.drafter == "none" and off.stats.rounds == 0 and off.stats.plain_steps > 0
    fixed, final = run_with(engine, params, SpeculationConfig(draft_max=2, adaptive=False))
    assert fixed == plain
    assert final.stats.rounds > 0 and set(final.stats.k_history) <= {1, 2}  # 1: the budget at the end


def run_with(engine, params, spec):
    events = list(engine.generate(PROMPT, params, spec))
    return [e.token for e in events if e.token is not None], events[-1]


def test_halt_ends_the_generation_with_its_reason(models):
    target, draft = models
    halt = Halt()
    engine = Engine(target, 256, drafter("draft", target, draft), SPECS["fixed-8"])
    tokens = []
    for event in engine.generate(PROMPT, SamplingParams(max_tokens=40, stop_at_eos=False), halt=halt):
        if event.token is None:
            final = event
            break
        tokens.append(event.token)
        if len(tokens) == 5:
            halt.reason = "stop"  # even in the middle of an accepted run of drafts
    assert len(tokens) == 5 and final.finish_reason == "stop"
    again, _ = run(engine, SamplingParams(max_tokens=40, stop_at_eos=False))  # the engine is reusable
    plain, _ = run(Engine(target, 256), SamplingParams(max_tokens=40, stop_at_eos=False))
    assert again == plain and again[:5] == tokens


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("spec", ["fixed-3", "adaptive"])
def test_seeded_sampling_with_speculation_equals_plain_seeded_sampling(models, kind, spec):
    target, draft = models
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=48, stop_at_eos=False,
                            presence_penalty=0.3)
    plain, _ = run(Engine(target, 256), params)
    ours, final = run(Engine(target, 256, drafter(kind, target, draft), SPECS[spec]), params)
    assert ours == plain
    assert final.stats.rounds > 0 and (final.stats.draft_n_accepted > 0 or kind == "ngram")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_identical_to_target_accepts_everything(models, temperature):
    target, draft = models
    params = SamplingParams(max_tokens=41, stop_at_eos=False, temperature=temperature, seed=3)
    _, final = run(Engine(target, 256, drafter("self", target, draft), SpeculationConfig(draft_max=4, adaptive=False)),
                   params)
    stats = final.stats
    assert stats.draft_n == 32  # 40 tokens after the first: 8 rounds of 4 drafts + 1 target token
    assert stats.draft_n_accepted == stats.draft_n
    assert stats.rounds == 8 and stats.mean_accepted_length == 5.0


def test_rollback_leaves_the_cache_as_plain_decoding_would(models):
    """After rounds with accepts and rejections, the target cache equals that of plain decoding."""
    target, draft = models
    params = SamplingParams(max_tokens=30, stop_at_eos=False)
    engine = Engine(target, 256, drafter("draft", target, draft), SpeculationConfig(draft_max=5, adaptive=False))
    tokens, final = run(engine, params)
    assert 0 < final.stats.draft_n_accepted < final.stats.draft_n  # both accepts and rejections happened
    plain = KVCache.for_model(target.model, 256)
    with torch.no_grad():
        target.model(torch.tensor([PROMPT]), plain)
        for t in tokens[:-1]:
            target.model(torch.tensor([[t]]), plain)
    n = plain.length
    assert engine.cache.length >= n
    assert all(torch.equal(a[:, :, :n], b[:, :, :n]) for a, b in zip(engine.cache.k, plain.k))
    assert all(torch.equal(a[:, :, :n], b[:, :, :n]) for a, b in zip(engine.cache.v, plain.v))


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_output_follows_target_distribution(tmp_path, seeded):
    """Engine level: the second token (the first a round emits) is distributed as the target says, with a
    seed per generation (the Gumbel choices) and without (rejection sampling)."""
    # 1,000 draws catch a wrong rule in each mode at p < 1e-5 (for five seeds of the draws; the test asks 1e-3): drawing
    # from p instead of the residual after a rejection (unseeded, p < 1e-13 at 1,500 draws) and exponential noise in
    # place of Gumbel noise (seeded, p < 1e-10 at 1,500)
    V, draws = 8, 1000
    target = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=1, vocab=V, logit_scale=8), tmp_path / "t")),
                        BF16, False)
    draft = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=2, vocab=V, logit_scale=8), tmp_path / "d")),
                       BF16, False)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, stop_at_eos=False)
    prompt = [1, 2, 3]
    exact = torch.zeros(V)  # P(t2) = sum over t1 of P(t1) P(t2 | t1), processed as the engine does
    with torch.no_grad():
        cache = KVCache.for_model(target.model, 16)
        p1 = sampling.process(target.model(torch.tensor([prompt]), cache, last_only=True)[0], params)[0]
        for t1 in range(V):
            if p1[t1] > 0:
                cache.rollback(3)
                p2 = sampling.process(target.model(torch.tensor([[t1]]), cache)[0], params)[0]
                exact += p1[t1] * p2
    engine = Engine(target, 16, DraftModelDrafter(draft, V, 16), SpeculationConfig(draft_max=1, adaptive=False))
    counts = torch.zeros(V)
    torch.manual_seed(0)  # unseeded generations draw their generator's seed from torch's global one
    for seed in range(draws):
        tokens, final = run(engine, SamplingParams(**{**params.__dict__, "seed": seed if seeded else None}), prompt)
        counts[tokens[1]] += 1
    assert final.stats.rounds >= 1 and final.stats.k_history[0] == 1
    assert counts[exact == 0].sum() == 0
    _, dof, p_value = chi_square(counts.double(), exact.double())
    assert dof >= 3 and p_value > 1e-3, (counts / draws, exact)


def test_vocabulary_compatibility(models, tmp_path):
    target, draft = models
    assert check_compatible(target.tokenizer, draft.tokenizer, 320, 384) == 320  # padding rows only: fine
    other = load_model(str(save_hf_dir(tiny_hf_model("qwen2", vocab=320), tmp_path)), BF16, False)
    other.tokenizer.backend.add_tokens(["<extra>"])  # one token the target lacks (as Gemma 3 27B's image token)
    assert check_compatible(target.tokenizer, other.tokenizer, 320, 384) == 320
    assert check_compatible(other.tokenizer, target.tokenizer, 384, 320) == 320
    with pytest.raises(QuickdraftError, match="fewer embedding rows"):
        check_compatible(target.tokenizer, other.tokenizer, 320, 320)
    other.tokenizer.backend.add_tokens([f"<more{i}>" for i in range(9)])  # 10 of 330 on one side: another model
    with pytest.raises(QuickdraftError, match="agree on the first 320, but 10 belong to one alone"):
        check_compatible(target.tokenizer, other.tokenizer, 320, 384)
    swapped = {t: i for t, i in draft.tokenizer.backend.get_vocab().items()}
    a, b = (t for t, i in sorted(swapped.items(), key=lambda x: x[1]) if i in (100, 101))
    other.tokenizer = type(target.tokenizer)(_swapped_backend(draft.tokenizer.backend, a, b))
    with pytest.raises(QuickdraftError, match="differs from the target's at id 100"):
        check_compatible(target.tokenizer, other.tokenizer, 320, 384)


def _swapped_backend(backend, a, b):
    """A copy of a tokenizer with two tokens' ids exchanged."""
    import json

    from tokenizers import Tokenizer as Backend

    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return Backend.from_str(json.dumps(spec))


def test_target_tokens_the_draft_lacks_reach_it_as_a_stand_in(models):
    """A draft sharing fewer ids than the target has (shared=300 of 320): the prompt and the output hold ids past
    them, which the draft reads as a stand-in and never proposes; greedy output is the target's alone."""
    target, draft = models
    prompt = PROMPT + [310, 319, 305] + PROMPT
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params, prompt)
    narrow = DraftModelDrafter(draft, target.config.vocab_size, 256, shared=300)
    ours, final = run(Engine(target, 256, narrow, SPECS["fixed-3"]), params, prompt)
    assert ours == plain and final.stats.rounds > 0
    narrow.begin(prompt)
    proposal = narrow.propose(prompt, lambda s: 4, SamplingParams(temperature=1.0, seed=0),
                              sampling.make_generator(0, torch.device("cpu")))
    assert proposal.q_draft[:, 300:].sum() == 0


def test_draft_with_fewer_rows_never_proposes_missing_ids(models):
    target, draft = models
    small = DraftModelDrafter(draft, 400, 256)  # target vocabulary larger than the draft's rows
    proposal = small.propose(PROMPT, lambda s: 4, SamplingParams(temperature=1.0, seed=0),
                             sampling.make_generator(0, torch.device("cpu")))
    assert proposal.q_draft.shape == (4, 400) and proposal.q_draft[:, 320:].sum() == 0


def test_draft_cache_keeps_only_the_common_prefix(models):
    """Stale drafts that happen to equal later tokens of the sequence must not be kept (a real bug:
    scanning back from the end kept them, and an all-equal cache left nothing to feed)."""
    target, draft = models
    d = DraftModelDrafter(draft, 320, 256)
    d.begin([1, 2, 3])
    with torch.no_grad():
        d._logits([9, 5, 6])  # drafts the target rejected at the first position
    assert d._sync([1, 2, 3, 4, 5, 6, 7]) == [4, 5, 6, 7]
    assert d.cache.length == 3 and d.tokens == [1, 2, 3]
    with torch.no_grad():
        d._logits([4, 5, 6, 7])
    assert d._sync([1, 2, 3, 4, 5, 6, 7]) == [7]  # everything cached: the last token is fed again
    assert d.cache.length == 6


LOGPROB_CASES = {"greedy": SamplingParams(max_tokens=32, stop_at_eos=False, logprobs=5),
                 "seeded": SamplingParams(max_tokens=32, stop_at_eos=False, logprobs=5, temperature=0.9, seed=3),
                 "greedy, post-sampling": SamplingParams(max_tokens=32, stop_at_eos=False, logprobs=3,
                                                         post_sampling=True, repetition_penalty=1.2),
                 "seeded, post-sampling": SamplingParams(max_tokens=32, stop_at_eos=False, logprobs=3, temperature=0.7,
                                                         top_k=40, seed=5, post_sampling=True)}


@pytest.mark.parametrize("case", list(LOGPROB_CASES))
def test_logprobs_are_the_same_with_speculation_on_and_off(models, case):
    """Each token's log-probability and its top alternatives, bit for bit: a plain step and a verification pass
    score a position from the same logits (llama.cpp reports 0.0 for every drafted token instead)."""
    target, draft = models
    params = LOGPROB_CASES[case]

    def scored(engine):
        events = [e for e in engine.generate(PROMPT, params) if e.token is not None]
        return [(e.token, e.logprob, e.top_logprobs) for e in events], engine

    plain, _ = scored(Engine(target, 256))
    assert len(plain) == 32 and all(lp <= 0 for _, lp, _ in plain)
    for spec in ("fixed-3", "adaptive"):
        ours, engine = scored(Engine(target, 256, drafter("combined", target, draft), SPECS[spec]))
        assert ours == plain, spec
    top = plain[0][2]
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    if params.post_sampling and params.greedy:  # the argmax is certain; nothing else could have been drawn
        assert all(lp == 0.0 and alternatives == [(t, 0.0)] for t, lp, alternatives in plain)


def test_raw_logprobs_are_the_models_distribution(models):
    """Against a fresh full pass over the sequence so far: the log-softmax of the model's logits at each position."""
    target, _ = models
    params = SamplingParams(max_tokens=6, stop_at_eos=False, logprobs=2, temperature=1.0, seed=0)
    events = [e for e in Engine(target, 256).generate(PROMPT, params) if e.token is not None]
    seq = list(PROMPT)
    for e in events:
        with torch.no_grad():
            logits = target.model(torch.tensor([seq]), KVCache.for_model(target.model))[0, -1].float()
        want = torch.log_softmax(logits, -1)
        assert abs(e.logprob - float(want[e.token])) < 0.05
        assert e.top_logprobs[0][0] == int(want.argmax())
        seq.append(e.token)


@pytest.mark.parametrize("kind", ["combined", "ngram"])
def test_each_token_says_which_drafter_proposed_it(models, kind):
    """Event.source/step/k (the chat page's colours) agree with the statistics: the kept drafts are the tokens of a
    drafter's source, each step ends with one token of the target's own, and a step's k is what it drafted."""
    target, draft = models
    params = SamplingParams(max_tokens=48, stop_at_eos=False)
    events = list(Engine(target, 256, drafter(kind, target, draft), SPECS["fixed-3"]).generate(PROMPT, params))
    tokens, stats = [e for e in events if e.token is not None], events[-1].stats
    kept = [e for e in tokens if e.source != "target"]
    assert len(kept) == stats.draft_n_accepted > 0
    assert {e.source for e in kept} <= set(stats.sources) and stats.sources  # "draft" / "ngram"
    steps = {}
    for e in tokens:
        steps.setdefault(e.step, []).append(e)
    assert sorted(steps) == list(range(len(steps)))
    assert [steps[s][0].k for s in sorted(steps)][1:] == stats.k_history[:len(steps) - 1]
    for run_ in steps.values():  # a step: its kept drafts, then the target's token (unless the budget cut it)
        sources = [e.source for e in run_]
        assert sources.count("target") <= 1 and "target" not in sources[:-1]
        assert len(sources) <= run_[0].k + 1
    plain = [e for e in Engine(target, 256).generate(PROMPT, params) if e.token is not None]
    assert {e.source for e in plain} == {"target"} and [e.step for e in plain] == list(range(48))


def test_a_draft_model_runs_no_pass_while_the_policy_decodes_plainly(models):
    """k = 0 is a plain step: the draft model feeds nothing then (it caught up every other plain step before, a
    draft pass of two tokens that made adaptive decoding slower than plain where speculation did not pay); its next
    round catches up in one pass and drafts from the whole sequence."""
    target, draft = models
    d = DraftModelDrafter(draft, target.config.vocab_size, 256)
    d.begin(PROMPT)
    length = d.cache.length
    seq = PROMPT + [7, 9, 11, 13, 15, 17]
    for n in range(len(PROMPT) + 1, len(seq) + 1):
        assert d.propose(seq[:n], lambda source: 0, SamplingParams(), None).tokens == []
    assert d.cache.length == length
    proposal = d.propose(seq, lambda source: 2, SamplingParams(), None)
    assert len(proposal.tokens) == 2 and d.tokens[:len(seq)] == seq and proposal.catch_up_s > 0


def test_a_probe_after_plain_steps_drafts_from_a_window_and_forgets_it(models):
    """After PROBE_AFTER plain steps a round drafts from the last PROBE_WINDOW tokens written after the prefix the
    draft has (not a prefill of every skipped token) and leaves the cache at that prefix; the round after it
    catches up in full."""
    from quickdraft.speculative.draft_model import PROBE_AFTER, PROBE_WINDOW

    target, draft = models
    d = DraftModelDrafter(draft, target.config.vocab_size, 256)
    d.begin(PROMPT)
    seq = PROMPT + [(7 * i) % 300 + 3 for i in range(PROBE_WINDOW + 10)]
    for n in range(PROBE_AFTER):
        d.propose(seq[:len(seq) - PROBE_AFTER + n + 1], lambda source: 0, SamplingParams(), None)
    assert len(d.propose(seq, lambda source: 2, SamplingParams(), None).tokens) == 2
    assert d.cache.length == len(PROMPT) and d.tokens == PROMPT
    d.propose(seq, lambda source: 2, SamplingParams(), None)
    assert d.tokens[:len(seq)] == seq
