"""The speed model of speculative decoding, in one place (the policy, bench, tune and doctor use it).

With t_plain one target step, v(k) = t_verify(k) / t_plain the cost of verifying k drafts (a pass over k + 1
tokens), r = t_draft / t_plain the cost of one drafted token and a_i the probability that draft i is accepted
given the ones before it were, a round of k drafts emits

    E[L](k) = 1 + sum_{i<=k} prod_{j<=i} a_j

tokens in t_verify(k) + k t_draft + t_catch_up seconds (t_catch_up: what the drafter spends per round feeding the
tokens it missed while another source drafted), where plain decoding emits one token in t_plain, so speculation
runs at E[L](k) / (v(k) + k r + c) times the speed of plain decoding (c = t_catch_up / t_plain; E[L](k) =
(1 - alpha^(k+1)) / (1 - alpha) when every a_i is alpha).
"""

from __future__ import annotations

from typing import Sequence


def expected_length(acceptance: Sequence[float]) -> float:
    """E[L]: tokens a round emits, drafting len(acceptance) tokens accepted with these conditional rates."""
    total, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        total += run
    return total


def round_seconds(t_verify: float, k: int, t_draft: float, t_catch_up: float = 0.0) -> float:
    """Seconds of a round: verifying k drafts, drafting them and catching up first."""
    return t_verify + k * t_draft + t_catch_up


def rate(acceptance: Sequence[float], t_verify: float, t_draft: float, t_catch_up: float = 0.0) -> float:
    """Tokens per second of rounds drafting len(acceptance) tokens."""
    return expected_length(acceptance) / round_seconds(t_verify, len(acceptance), t_draft, t_catch_up)


def speedup(expected: float, v_k: float, k: int, r: float, c: float = 0.0) -> float:
    """E[L](k) / (v(k) + k r + c): speculation's speed over plain decoding."""
    return expected / (v_k + k * r + c)
