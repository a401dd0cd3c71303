"""Prompt lookup when it has a match, the draft model otherwise."""

from __future__ import annotations

from quickdraft.spec.base import KFor, Proposal
from quickdraft.spec.draft_model import DraftModelDrafter
from quickdraft.spec.ngram import NgramDrafter


class CombinedDrafter:
    sources = ("ngram", "draft")

    def __init__(self, ngram: NgramDrafter, draft: DraftModelDrafter):
        self.ngram, self.draft = ngram, draft
        self.device = draft.device

    def begin(self, prompt: list[int]) -> None:
        self.ngram.begin(prompt)
        self.draft.begin(prompt)

    def propose(self, seq, k_for: KFor, params, generator, constraint=None) -> Proposal:
        proposal = self.ngram.propose(seq, k_for, params, generator, constraint)
        if proposal.tokens:
            return proposal
        return self.draft.propose(seq, k_for, params, generator, constraint)
