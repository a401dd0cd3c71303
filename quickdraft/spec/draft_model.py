"""A smaller model of the same family drafts tokens autoregressively, with its own KV cache."""

from __future__ import annotations

import time

import torch

from quickdraft import grammar, sampling
from quickdraft.config import SamplingParams
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.spec.base import KFor, Proposal


class DraftModelDrafter:
    sources = ("draft",)

    def __init__(self, model, target_vocab: int, capacity: int, p_min: float = 0.0):
        self.model = model
        self.device = model.device
        self.target_vocab = target_vocab
        self.p_min = p_min
        self.cache = KVCache.for_model(model, capacity)
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds
        self.matched = 0  # length of the prefix of tokens known to equal the sequence

    @torch.inference_mode()
    def begin(self, prompt: list[int]) -> None:
        """Prefill the prompt now, so that a round's draft time is the cost of drafting alone."""
        self.cache.reset()
        self.tokens = []
        self.matched = 0
        if prompt:
            self._logits(prompt)

    def _sync(self, seq: list[int]) -> list[int]:
        """Keep the longest cached prefix that still matches seq; return the tokens still to feed.

        This is the one place that knows the draft's cache can run behind or beside the sequence: after a
        fully accepted round the draft never fed its own last drafted token, so that token and the
        target's extra one are both pending; after a rejection, its cache holds drafts the target did not
        keep. At least one token is always left to feed: the next draft needs its logits.
        """
        n = self.matched  # tokens[:matched] == seq[:matched] held at the last sync; seq only grows
        limit = min(len(self.tokens), len(seq) - 1)
        while n < limit and self.tokens[n] == seq[n]:
            n += 1
        self.cache.rollback(n)
        del self.tokens[n:]
        self.matched = n
        return seq[n:]

    def _logits(self, feed: list[int]) -> torch.Tensor:
        """Run feed through the draft; logits of the last position over the target's vocabulary (V,)."""
        logits = self.model(torch.tensor([feed], device=self.device), self.cache, last_only=True)[0, 0]
        self.tokens += feed
        V = self.target_vocab
        if logits.shape[0] >= V:  # ids the target does not have are never proposed
            return logits[:V]
        return torch.cat([logits, logits.new_full((V - logits.shape[0],), float("-inf"))])

    @torch.inference_mode()
    def propose(self, seq: list[int], k_for: KFor, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Proposal:
        k = k_for("draft")
        feed = self._sync(seq)
        catch_up_s = 0.0
        if len(feed) > 2:  # after plain steps: catch up first, so that timing a round times drafting
            # (2 pending tokens is the normal case after a fully accepted round: fed with the draft step)
            t0 = time.perf_counter()
            self._logits(feed[:-1])
            feed = feed[-1:]
            catch_up_s = time.perf_counter() - t0
        tokens, q_rows = [], []
        try:
            self._draft(seq, k, feed, params, generator, constraint, tokens, q_rows)
        finally:
            if constraint is not None:  # the drafts were looked ahead: the state is the sequence's again
                constraint.pop(len(tokens))
        q_draft = torch.stack(q_rows) if q_rows else None
        return Proposal(tokens, "draft", q_draft, catch_up_s)

    def _draft(self, seq, k, feed, params, generator, constraint, tokens: list[int], q_rows: list) -> None:
        """Draft up to k tokens into tokens (and their distributions into q_rows), each masked by
        constraint at the state it is drafted in (the constraint is advanced through them)."""
        for _ in range(k):
            history = sampling.history(seq, params, self.device, appended=tokens)
            logits = self._logits(feed)[None]
            if constraint is not None:
                logits = grammar.apply(logits, constraint.allowed(self.device))
            if params.greedy:
                logits = sampling.penalize(logits, params, history)
                token = int(logits.argmax())
                confident = self.p_min <= 0 or float(logits.softmax(-1).max()) >= self.p_min
            else:
                q = sampling.process(logits, params, history)
                if params.seed is not None:  # guess the target's seeded choice with the same noise
                    token = int(sampling.gumbel_choice(q, params.seed, len(seq) + len(tokens))[0])
                else:
                    token = int(sampling.sample(q, generator))
                q_rows.append(q[0])
                confident = self.p_min <= 0 or float(q.max()) >= self.p_min
            if not confident and tokens:  # stop early: the draft itself doubts this token
                del q_rows[len(tokens):]
                break
            if constraint is not None:  # drawn from the masked distribution: the matcher takes it
                constraint.advance(token)
            tokens.append(token)
            if constraint is not None and constraint.stopped:  # the output is complete: nothing follows
                break
            feed = [token]
