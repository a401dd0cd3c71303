"""Suffix decoding (speculative/suffix.py): its proposals against arctic-inference's (the reference vLLM calls, recorded
in tests/reference/suffix.json by tests/reference_data.py), its output against plain decoding's, and its history's
scope and bounds."""

import pytest
import torch

from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Batch, Engine
from quickdraft.speculative.draft import Draft
from quickdraft.speculative.suffix import History, SuffixDrafter, SuffixTree
from quickdraft.tools.verify import chi_square
from tests.helpers import PROMPT, tokens_of as run
from tests.reference_data import load, suffix_streams


def test_the_proposals_are_the_references_on_the_same_token_streams():
    """Every recorded speculate call of arctic-inference 0.3.0's SuffixDecodingCache (the request's tree over its
    prompt and responses, the global one over every request's responses as they come, the better score of the two,
    the request's own on a tie): the same tokens, probabilities, score and match length."""
    reference = load("suffix")
    assert reference["reference"] == "arctic-inference==0.3.0" and len(reference["sessions"]) >= 40
    calls = 0
    for seed, session in enumerate(reference["sessions"]):
        assert suffix_streams(seed)["requests"][0]["prompt"] == session["requests"][0]["prompt"]  # (the same streams)
        shared = SuffixTree(session["depth"])
        for r, request in enumerate(session["requests"]):
            own = SuffixTree(session["depth"])
            own.extend(0, request["prompt"])
            seq = list(request["prompt"])
            for step in request["steps"]:
                own.extend(0, step["add"])
                shared.extend(r, step["add"])
                seq += step["add"]
                context = seq[-step["context_len"]:]
                mine = own.speculate(context, step["max_spec_tokens"], step["factor"], step["min_prob"])
                theirs = shared.speculate(context, step["max_spec_tokens"], step["factor"], step["min_prob"])
                tokens, probs, score, match, _ = mine if mine[2] >= theirs[2] else theirs
                want = step["proposed"]
                assert (tokens, probs, float(score), match) == (want["tokens"], want["probs"], want["score"],
                                                                want["match_len"]), (seed, r)
                calls += 1
    assert calls > 2000


def test_a_tree_forgets_a_sequence_as_if_it_never_had_it():
    """Removing a sequence (the history's oldest answer) leaves the counts, order and proposals of a tree built
    without it."""
    a, b = SuffixTree(8), SuffixTree(8)
    streams = [[1, 2, 3, 1, 2, 4] * 5, [2, 3, 1, 2, 3] * 4, [1, 2, 4, 1, 2, 3] * 3]
    for i, s in enumerate(streams):
        a.extend(i, s)
        if i:
            b.extend(i, s)
    a.remove(0)
    for context in ([1, 2], [2, 3], [3, 1, 2], [4, 1]):
        assert a.speculate(context, 8, 2.0, 0.0)[:4] == b.speculate(context, 8, 2.0, 0.0)[:4]
    assert a.nodes == b.nodes and a.root.count == b.root.count


def test_history_is_per_scope_bounded_and_can_be_off():
    history = History(budget=100)
    for i in range(10):
        history.add("alice", list(range(i, i + 30)))
    assert history.tokens("alice") <= 100 and history.tree("bob") is None
    history.add("bob", [500] * 40)
    assert history.tree("alice").speculate([500, 500], 4, 4.0, 0.0)[0] == []  # bob's answers are bob's
    assert history.tree("bob").speculate([500, 500], 4, 4.0, 0.0)[0] == [500] * 4
    off = History(budget=0)
    off.add("alice", [1, 2, 3])
    assert off.tree("alice") is None and off.tokens() == 0
    assert Draft.parse("suffix") == Draft("suffix") and str(Draft.parse("suffix")) == "suffix"


GREEDY = SamplingParams(max_tokens=48, stop_at_eos=False)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=48, stop_at_eos=False)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [SpeculationConfig(draft_max=4, adaptive=False), SpeculationConfig(draft_max=8),
                                  SpeculationConfig(draft_max=4, adaptive=False, tree=3)],
                         ids=["fixed-4", "adaptive", "tree-3"])
def test_suffix_drafts_give_plain_decodings_output_and_learn_from_earlier_answers(bf16_pair, params, spec):
    """Its drafts (from the prompt, the answer so far, and a second generation from the first's answer) change
    nothing: the output is plain decoding's; the second generation of the same prompt drafts its whole answer from
    the history."""
    target, _ = bf16_pair
    plain, _ = run(Engine(target, 256), params)
    engine = Engine(target, 256, SuffixDrafter(), spec)
    first, _ = run(engine, params)
    again, final = run(engine, params)
    assert first == again == plain
    if spec.tree == 1 and not spec.adaptive and params.seed is None:  # the whole answer is in the history now: every
        stats = final.stats  # round drafts 4 and keeps them
        assert stats.draft_n_accepted == stats.draft_n >= 4 * (len(plain) // 5 - 1), stats.to_dict()
    assert final.stats.rounds > 0


def test_a_batch_with_suffix_drafts_gives_each_answer_alone(bf16_pair):
    target, _ = bf16_pair
    prompts = [PROMPT, PROMPT[::-1], PROMPT[10:] + PROMPT[:10]]
    want = [run(Engine(target, 256), GREEDY, p)[0] for p in prompts]
    engine = Engine(target, 256, SuffixDrafter(), SpeculationConfig(draft_max=4, adaptive=False), slots=4)
    for _ in range(2):  # the second time, each drafts from the history of all three
        batch, got = Batch(engine, 3), {}
        seqs = [batch.add(p, GREEDY) for p in prompts]
        while batch.active:
            batch.step(lambda s, e: got.setdefault(id(s), []).append(e.token))
        assert [[t for t in got[id(s)] if t is not None] for s in seqs] == want
    assert sum(s.stats.draft_n_accepted for s in seqs) > 0


def test_scopes_do_not_draft_from_each_others_answers(bf16_pair):
    """Another client's answer is not drafted from (its timing would tell that it had been asked): alice's second
    request drafts her first answer back, bob's first does not see it."""
    target, _ = bf16_pair
    engine = Engine(target, 256, SuffixDrafter(), SpeculationConfig(draft_max=4, adaptive=False))

    def once(scope):
        s = engine.start(PROMPT, GREEDY, scope=scope)
        while not s.ended:
            list(engine.step([s]))
        return s.stats

    once("alice")
    assert once("bob").draft_n_accepted < once("alice").draft_n_accepted


def test_sampled_output_follows_the_target_distribution(tmp_path):
    """Unseeded at T = 1 with a history that proposes one continuation: the token after it is distributed as the
    target says (a deterministic proposal is a point mass to the exact rule)."""
    from quickdraft import sampling
    from quickdraft.config import EngineConfig
    from quickdraft.runtime.kv_cache import KVCache
    from quickdraft.weights.loader import load_model
    from tests.helpers import save_hf_dir, tiny_hf_model

    V, draws = 8, 600
    config = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=64)
    target = load_model(str(save_hf_dir(tiny_hf_model("llama", seed=1, vocab=V, logit_scale=8), tmp_path / "t")),
                        config, False)
    params = SamplingParams(temperature=1.0, max_tokens=2, stop_at_eos=False)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the suffix tree proposes 3
    with torch.no_grad():
        cache = KVCache.for_model(target.model, 16)
        exact = sampling.process(target.model(torch.tensor([prompt]), cache, last_only=True)[0], params)[0]
    engine = Engine(target, 16, SuffixDrafter(History(0)), SpeculationConfig(draft_max=1, adaptive=False))
    counts = torch.zeros(V)
    torch.manual_seed(0)
    for _ in range(draws):
        tokens, final = run(engine, params, prompt)
        counts[tokens[0]] += 1
    _, dof, p_value = chi_square(counts.double(), exact.double())
    assert p_value > 1e-3, (counts / draws, exact)
