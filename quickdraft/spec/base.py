"""What every drafter shares: the proposal it returns and the interface the engine calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from quickdraft.config import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]
    source: str  # which drafter proposed them ("draft", "ngram")
    q_draft: torch.Tensor | None = None  # (len(tokens), V) processed distributions; None: deterministic
    catch_up_s: float = 0.0  # time spent feeding tokens the drafter had not seen (not drafting proper)

    def q_rows(self, vocab: int, device) -> torch.Tensor:
        """The distributions the tokens were drawn from; one-hot rows for a deterministic proposal."""
        if self.q_draft is not None:
            return self.q_draft
        q = torch.zeros(len(self.tokens), vocab, device=device)
        return q.scatter_(1, torch.tensor(self.tokens, device=device)[:, None], 1.0)


# How many tokens to draft now, asked per source: the engine's policy answers.
KFor = Callable[[str], int]


class Drafter(Protocol):
    sources: tuple[str, ...]  # the policy keeps statistics per source
    device: torch.device | None

    def begin(self, prompt: list[int]) -> None:
        """Start a generation: forget the previous one and take in the prompt (a draft model prefills it)."""

    def propose(self, seq: list[int], k_for: KFor, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Proposal:
        """Propose up to k_for(source) tokens to follow seq (prompt + tokens generated so far).

        constraint (a grammar.Constraint at the state after seq): propose only what it allows, and leave
        its state as it was found.
        """
