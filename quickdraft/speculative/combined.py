"""Prompt lookup when it has a match, another drafter (a draft model) otherwise."""

from __future__ import annotations

from quickdraft.speculative.base import Drafter, KFor, Offer, Proposal
from quickdraft.speculative.ngram import NgramDrafter


class CombinedDrafter(Drafter):
    def __init__(self, ngram: NgramDrafter, draft: Drafter):
        self.ngram, self.draft = ngram, draft
        self.sources = ngram.sources + draft.sources
        self.per_round = ngram.per_round + draft.per_round
        self.device = draft.device
        self.samples = draft.samples
        self.name = f"ngram+{draft.name}"

    def fork(self) -> "CombinedDrafter":
        return CombinedDrafter(self.ngram.fork(), self.draft.fork())

    def adopt(self, other: "CombinedDrafter", n: int) -> None:
        self.draft.adopt(other.draft, n)

    def forget(self) -> None:
        self.draft.forget()

    @property
    def models(self) -> tuple:
        return self.draft.models

    @property
    def reads_hidden(self) -> bool:
        return self.draft.reads_hidden

    def attach(self, cache) -> None:
        self.draft.attach(cache)

    @property
    def max_draft(self) -> int | None:
        return self.draft.max_draft

    @property
    def cut_head(self) -> bool:
        return self.draft.cut_head

    def lag(self, seq: list[int], source: str) -> int:
        return self.draft.lag(seq, source)

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        self.ngram.begin(prompt)
        self.draft.begin(prompt, prefill)

    @property
    def trees(self) -> bool:
        return self.draft.trees

    def propose(self, seq, k_for: KFor, params, generator, constraint=None, branches=None) -> Proposal:
        proposal = self.ngram.propose(seq, k_for, params, generator, constraint)
        if proposal.tokens:
            return proposal
        if branches is not None:
            return self.draft.propose(seq, k_for, params, generator, constraint, branches)
        return self.draft.propose(seq, k_for, params, generator, constraint)

    @property
    def batchable(self) -> bool:
        return self.draft.batchable

    def pass_logits(self, feed):
        return self.draft.pass_logits(feed)

    def batched_pass(self, drafters: list, feeds: list) -> list:
        return self.draft.batched_pass([d.draft for d in drafters], feeds)

    def propose_steps(self, seq, k_for: KFor, params, generator, constraint=None, branches=None):
        proposal = self.ngram.propose(seq, k_for, params, generator, constraint)
        if proposal.tokens:
            return proposal
        return (yield from self.draft.propose_steps(seq, k_for, params, generator, constraint, branches))

    def cache_bytes(self) -> int:
        return self.draft.cache_bytes()

    def pass_seconds(self, prompt: list[int]) -> float:
        return self.draft.pass_seconds(prompt)

    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        looked_up, drafted = self.ngram.offers(prompt, output, kmax), self.draft.offers(prompt, output, kmax)
        return [a if a.source else b for a, b in zip(looked_up, drafted)]

    def replay_round(self, source, drafted, stopped_early, kept, behind):
        return self.draft.replay_round(source, drafted, stopped_early, kept, behind)
