"""The accept rules: crafted cases with known outcomes, and a seeded statistical test of exactness."""

import math

import pytest
import torch

from quickdraft import sampling
from quickdraft.config import SamplingParams
from quickdraft.speculative.accept import accept_greedy, accept_sampled


def onehot(ids, V=6):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


@pytest.mark.parametrize("target, drafts, tokens, n", [
    ([3, 1, 4, 1], [3, 1, 4], [3, 1, 4, 1], 3),  # all accepted, plus the target's bonus token
    ([3, 1, 5, 2], [3, 1, 4], [3, 1, 5], 2),  # third rejected: replaced by the target's token
    ([2, 1, 4, 1], [3, 1, 4], [2], 0),  # first rejected: later agreement does not count
])
def test_greedy_crafted(target, drafts, tokens, n):
    assert accept_greedy(torch.tensor(target), torch.tensor(drafts)) == (tokens, n)


def test_sampled_identical_distributions_accept_everything():
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4, 0, 0], [0, 0, 0, 0, 0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = torch.multinomial(p[:2], 1, generator=gen)[:, 0]
        tokens, n = accept_sampled(p, p[:2], drafts, gen)
        assert n == 2 and tokens[:2] == drafts.tolist() and tokens[2] in (4, 5)


def test_sampled_draft_the_target_rules_out_is_always_rejected():
    p = onehot([2, 0]) * 0.5 + onehot([3, 0]) * 0.5  # row 0: tokens 2 or 3
    q = onehot([5])  # the draft is sure of token 5, which the target never emits
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        tokens, n = accept_sampled(p, q, torch.tensor([5]), gen)
        assert n == 0 and tokens[0] in (2, 3)  # residual max(0, p - q) = p here


def test_sampled_deterministic_draft_accepted_with_target_probability():
    """A one-hot q (n-gram drafts) is accepted with probability p(x); on rejection x is never emitted."""
    p = torch.tensor([[0.7, 0.3, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    gen = torch.Generator().manual_seed(1)
    outcomes = [accept_sampled(p, onehot([1]), torch.tensor([1]), gen) for _ in range(4000)]
    accepted = sum(n for _, n in outcomes) / len(outcomes)
    assert abs(accepted - 0.3) < 0.03
    assert all(tokens == [0] for tokens, n in outcomes if n == 0)


# ---- statistics: emitted tokens follow p_target -------------------------------------------------

# 5,000 rounds: test_a_wrong_rule_is_caught finds the plausible bug below at p < 1e-55 in both settings (and with
# the rounds' seeds 5 to 8 too); 20,000 found it at p < 1e-169, far past its 1e-6
V, K, DRAWS = 8, 3, 5000


def distributions(params: SamplingParams, seed: int):
    """Position-independent target and draft distributions, processed by the real sampler chain."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(1, V, generator=g) * 2
    draft_logits = target_logits + torch.randn(1, V, generator=g) * 1.5  # a draft that is often wrong
    return sampling.process(target_logits, params)[0], sampling.process(draft_logits, params)[0]


def wrong_rule(p_target, q_draft, drafts, generator):
    """A plausible bug: on rejection, sample from p_target instead of the residual max(0, p - q)."""
    tokens, n = accept_sampled(p_target, q_draft, drafts, generator)
    if n < len(drafts):
        tokens[-1] = int(torch.multinomial(p_target[n], 1, generator=generator))
    return tokens, n


def first_two_tokens(rule, p, q, seed):
    """Simulate whole speculative rounds (k = K) until two tokens are emitted; return their counts."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(2, V)
    P, Q = p.expand(K + 1, V), q.expand(K, V)
    for _ in range(DRAWS):
        out = []
        while len(out) < 2:
            drafts = torch.multinomial(Q, 1, generator=gen)[:, 0]
            tokens, _ = rule(P, Q, drafts, gen)
            out += tokens
        counts[0, out[0]] += 1
        counts[1, out[1]] += 1
    return counts


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs (cells with probability 0 must be empty)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target rules out was emitted"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square upper tail (no scipy needed)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


SETTINGS = [SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS, ids=["t0.6-p0.9", "t1.0-p0.9"])
def test_emitted_tokens_follow_target_distribution(params):
    p, q = distributions(params, seed=3)
    counts = first_two_tokens(accept_sampled, p, q, seed=4)
    for position in range(2):
        assert chi_square_pvalue(counts[position], p) > 1e-3, (counts[position] / DRAWS, p)


@pytest.mark.parametrize("params", SETTINGS, ids=["t0.6-p0.9", "t1.0-p0.9"])
def test_a_wrong_rule_is_caught(params):
    p, q = distributions(params, seed=3)
    counts = first_two_tokens(wrong_rule, p, q, seed=4)
    assert min(chi_square_pvalue(counts[i], p) for i in range(2)) < 1e-6
