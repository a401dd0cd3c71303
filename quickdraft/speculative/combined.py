"""Chained drafters (`--draft mtp,ngram`, `--draft DIR,ngram`, `ngram+MODEL`): each round the first of them that
proposes drafts. A drafter proposes nothing where it has nothing (n-gram lookup without a match) or where the policy
gives its source no tokens this round (its measured acceptance does not pay for its passes: speculative/policy.py),
so the order is a preference and the policy's costs pick among them round by round.

Each member keeps its own state: one that sat out rounds catches up when next asked (a draft model takes in the
tokens it missed, a head the target's states it missed), as it would after plain steps. At most one member reads the
target's layer states (KVCache.keep_features: eagle3, dflash); mtp reads the final hidden states beside them.
"""

from __future__ import annotations

from quickdraft.speculative.base import Drafter, KFor, Offer, Proposal


class ChainDrafter(Drafter):
    kind = "chain"

    def __init__(self, members: list[Drafter]):
        self.members = list(members)
        self.sources = tuple(dict.fromkeys(s for m in self.members for s in m.sources))
        self.per_round = tuple(dict.fromkeys(s for m in self.members for s in m.per_round))
        self.device = next((m.device for m in self.members if m.device is not None), None)
        self.samples = any(m.samples for m in self.members)
        self.name = ",".join(m.name for m in self.members)
        # the member whose passes may run beside other sequences' (a draft model's on the CPU): the first such
        self.batched = next((m for m in self.members if m.batchable), None)

    def fork(self) -> "ChainDrafter":
        chain = ChainDrafter([m.fork() for m in self.members])
        chain.name = self.name
        return chain

    def adopt(self, other: "ChainDrafter", n: int) -> None:
        for mine, theirs in zip(self.members, other.members):
            mine.adopt(theirs, n)

    def forget(self) -> None:
        for m in self.members:
            m.forget()

    def _owner(self, source: str) -> Drafter:
        """The member drafting as `source` (the last member for a plain step's "")."""
        return next((m for m in self.members if source in m.sources), self.members[-1])

    @property
    def models(self) -> tuple:
        return tuple({id(model): model for m in self.members for model in m.models}.values())  # (not hashable)

    @property
    def reads_hidden(self) -> bool:
        return any(m.reads_hidden for m in self.members)

    def attach(self, cache) -> None:
        for m in self.members:
            if m.reads_hidden:
                m.attach(cache)

    @property
    def max_draft(self) -> int | None:
        bounds = [m.max_draft for m in self.members if m.max_draft is not None]
        return min(bounds) if bounds else None

    @property
    def cut_head(self) -> bool:
        return any(m.cut_head for m in self.members)

    @property
    def trees(self) -> bool:
        return any(m.trees for m in self.members)

    def lag(self, seq: list[int], source: str) -> int:
        return self._owner(source).lag(seq, source)

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        for m in self.members:
            m.begin(prompt, prefill)

    def scoped(self, scope) -> None:
        for m in self.members:
            m.scoped(scope)

    def finish(self, tokens: list[int], prompt_n: int) -> None:
        for m in self.members:
            m.finish(tokens, prompt_n)

    def _ask(self, member: Drafter, seq, k_for: KFor, params, generator, constraint, branches) -> Proposal:
        if branches is not None and member.trees:
            return member.propose(seq, k_for, params, generator, constraint, branches)
        return member.propose(seq, k_for, params, generator, constraint)

    def propose(self, seq, k_for: KFor, params, generator, constraint=None, branches=None) -> Proposal:
        proposal = Proposal([], self.members[-1].sources[0] if self.members[-1].sources else "")
        for m in self.members:
            proposal = self._ask(m, seq, k_for, params, generator, constraint, branches)
            if proposal.tokens:
                return proposal
        return proposal

    @property
    def batchable(self) -> bool:
        return self.batched is not None

    def pass_logits(self, feed):
        return self.batched.pass_logits(feed)

    def batched_pass(self, drafters: list, feeds: list) -> list:
        return self.batched.batched_pass([d.batched for d in drafters], feeds)

    def propose_steps(self, seq, k_for: KFor, params, generator, constraint=None, branches=None):
        proposal = Proposal([], "")
        for m in self.members:
            if m is self.batched:
                proposal = yield from m.propose_steps(seq, k_for, params, generator, constraint, branches)
            else:
                proposal = self._ask(m, seq, k_for, params, generator, constraint, branches)
            if proposal.tokens:
                return proposal
        return proposal

    def cache_bytes(self) -> int:
        return sum(m.cache_bytes() for m in self.members)

    def pass_seconds(self, prompt: list[int]) -> float:
        return max(m.pass_seconds(prompt) for m in self.members)

    @classmethod
    def planned(cls, draft, target_cfg, device, dtype, context: int, window: int | None = None) -> list:
        return [item for part in draft.parts for item in part.drafter_class.planned(part, target_cfg, device, dtype,
                                                                                     context, window)]

    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """At each position the first member's offer that has a source (what propose would take)."""
        each = [m.offers(prompt, output, kmax) for m in self.members]
        return [next((o for o in column if o.source), column[-1]) for column in zip(*each)]

    def replay_round(self, source, drafted, stopped_early, kept, behind):
        return self._owner(source).replay_round(source, drafted, stopped_early, kept, behind)


def CombinedDrafter(ngram: Drafter, draft: Drafter) -> ChainDrafter:  # noqa: N802: `ngram+MODEL`, a chain of two
    chain = ChainDrafter([ngram, draft])
    chain.name = f"ngram+{draft.name}"
    return chain
