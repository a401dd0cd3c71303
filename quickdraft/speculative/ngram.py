"""Prompt lookup: propose what followed the most recent earlier occurrence of the sequence's suffix."""

from __future__ import annotations

from quickdraft.speculative.base import Drafter, KFor, Offer, Proposal


class NgramDrafter(Drafter):
    """No model: an index from every n-gram (min_n <= n <= max_n) seen so far to where it last ended.

    The longest suffix of the sequence that occurred earlier wins; its continuation is the proposal.
    The index grows incrementally as the sequence does, so a round costs O(max_n) lookups.
    """

    kind = "ngram"
    named = lookup = True
    sources = ("ngram",)
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.begin([])

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "NgramDrafter":
        return cls()

    def fork(self) -> "NgramDrafter":
        return NgramDrafter(self.min_n, self.max_n)

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # continuation starts < indexed are in the index

    def _update(self, seq: list[int]) -> None:
        """seq only grows within a generation (the engine calls begin() at the start of each)."""
        # Register n-grams ending just before e for e < len(seq): each has a continuation seq[e:].
        for e in range(max(self.indexed, self.min_n), len(seq)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.index[tuple(seq[e - n:e])] = e
        self.indexed = max(self.indexed, len(seq))

    def propose(self, seq, k_for: KFor, params, generator, constraint=None) -> Proposal:
        k = k_for("ngram")
        if k <= 0 or len(seq) <= self.min_n:
            return Proposal([], "ngram")
        self._update(seq)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            e = self.index.get(tuple(seq[-n:]))
            if e is not None:
                tokens = seq[e:e + k]
                if constraint is not None:  # cut where the grammar would refuse: the target surely would
                    tokens = tokens[:constraint.valid_prefix(tokens)]
                return Proposal(tokens, "ngram")
        return Proposal([], "ngram")

    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Lookup is deterministic in the sequence: its proposal at each position is asked for directly."""
        self.begin(prompt)
        out = [Offer("", 0, 0)]  # t = 0: the first token comes from the prompt's pass
        for t in range(1, len(output)):
            tokens = self.propose(prompt + output[:t], lambda source: kmax, None, None).tokens
            kept = next((i for i, (a, b) in enumerate(zip(tokens, output[t:])) if a != b),
                        min(len(tokens), len(output) - t))
            out.append(Offer("ngram", len(tokens), kept) if tokens else Offer("", 0, 0))
        return out
