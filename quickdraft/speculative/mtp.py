"""The target's own multi-token-prediction layers draft (Qwen3.5+: `--draft mtp`), fed its hidden states.

After each target pass the engine's cache holds every position's final hidden state (KVCache.keep_hidden). Each
round the MTP block (models/transformer.MTP) first takes in the pairs it has not seen, (hidden of position p, token
p + 1) for every committed p, in one pass; the last pair's logits guess the first draft. A chain follows: each
further draft comes from the MTP block's own hidden state and the token it just drafted. The chained entries of its
cache are dropped after the round (they rest on its own guesses, not on the target's states). Drafting and
verification are the draft model's (DraftModelDrafter._draft: greedy, seeded or sampled, masked by a grammar,
stopped early below --draft-p-min): exactness is the engine's, whatever the drafts.

The MTP block is one decoder layer and the head: its step costs a small share of a target step (r), which is why
drafters built into models are where the large factors are.
"""

from __future__ import annotations

import time

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import common_prefix
from quickdraft.speculative.base import Offer, Proposal, replay_chain
from quickdraft.speculative.draft_model import CATCH_UP, DraftModelDrafter
from quickdraft.weights import memory


class MtpDrafter(DraftModelDrafter):
    kind = "mtp"
    named = True
    text_model = False
    sources = ("mtp",)
    samples = True
    reads_hidden = True

    def __init__(self, target, capacity: int, p_min: float = 0.0):
        if target.model.mtp is None:
            raise QuickdraftError(f"{target.name} has no multi-token-prediction layers (its config has no "
                                  "mtp_num_hidden_layers, or its file dropped them): use another draft")
        self.lm = target
        self.device = target.device
        self.name = "mtp"
        self.target_vocab = self.shared = target.config.vocab_size
        self.p_min = p_min
        self.capacity = capacity
        self.cache = KVCache(target.model.mtp.kv_layout(), capacity, dtype=target.model.dtype, device=target.device)
        self.target_cache: KVCache | None = None
        self.chain: tuple[list[int], int] | None = None  # the round's first pass: (sequence, positions committed)
        self.hidden: torch.Tensor | None = None  # the MTP block's last hidden state, for the next chained step
        self.seen: list[int] = []  # the sequence the pairs in its cache came from (its entry p: tokens up to p + 1)

    def fork(self) -> "MtpDrafter":
        return MtpDrafter(self.lm, self.capacity, self.p_min)

    def adopt(self, other: "MtpDrafter", n: int) -> None:
        """Its entry p pairs the hidden state of position p with token p + 1: those of the first n tokens are
        other's first n - 1."""
        self.cache.copy_prefix(other.cache, min(other.cache.length, max(n - 1, 0)))
        self.seen = list(other.seen[:n])

    def forget(self) -> None:
        """Its pairs rest on the slot's hidden states, which the slot forgot."""
        self.cache.reset()
        self.seen = []

    @classmethod
    def load(cls, draft, target, load) -> list:
        return []

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "MtpDrafter":
        return cls(target, capacity, speculation.p_min)

    @property
    def models(self) -> tuple:
        return ()  # its weights are the target's own

    def attach(self, cache: KVCache) -> None:
        """The engine's cache, whose hidden states the rounds read."""
        cache.keep_hidden(self.lm.config.dim)
        self.target_cache = cache

    @torch.inference_mode()
    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        """Take in the prompt's pairs now (the engine has run the target's prefill): a round's draft time is then
        the cost of drafting alone. Pairs of the slot's last generation that the prompt begins with are kept (the
        target's hidden states there are kept too)."""
        self.cache.rollback(min(self.cache.length, max(common_prefix(self.seen, prompt) - 1, 0)))
        self.seen = list(prompt)
        hidden = self.target_cache.hidden if self.target_cache is not None else None
        if self.cache.length < len(prompt) - 1 and hidden is not None and prefill:
            self._pairs(prompt, len(prompt) - 1)

    def _pairs(self, seq: list[int], end: int):
        """The pairs (hidden of p, seq[p + 1]) for p from the block's cache length to end, in one pass."""
        start = self.cache.length
        ids = torch.tensor([seq[start + 1:end + 1]], device=self.device)
        return self.lm.model.mtp_step(ids, self.target_cache.hidden[start:end][None], self.cache)

    @torch.inference_mode()
    def propose(self, seq: list[int], k_for, params, generator, constraint=None, branches=None) -> Proposal:
        if self.target_cache is None or self.target_cache.hidden is None:
            raise QuickdraftError("the mtp drafter reads the target's hidden states: build its engine with it "
                                  "(Engine(target, context, drafter))")
        k = k_for("mtp")
        if k == 0:  # a plain step: the pairs are taken in when it next drafts (as a draft model catches up)
            return Proposal([], "mtp")
        committed = len(seq) - 1  # the target has run positions 0 .. committed - 1; seq[committed] is pending
        self.cache.rollback(min(self.cache.length, committed))
        self.seen = seq
        catch_up_s = 0.0
        if committed - self.cache.length > CATCH_UP:  # after plain steps or n-gram rounds: caught up apart, timed
            t0 = time.perf_counter()
            self._pairs(seq, committed - 1)
            catch_up_s = time.perf_counter() - t0
        self.chain = (seq, committed)
        try:
            return self._pending_chain(seq, k, params, generator, constraint, "mtp", branches, catch_up_s)
        finally:
            self.cache.rollback(min(committed, self.cache.length))  # chained entries rest on the block's own guesses

    def _logits(self, feed) -> torch.Tensor:
        """The first call of a round: the pairs not yet seen, up to the pending token; then one chained step for
        the token just drafted (feed: a list, or the draft still on the device)."""
        model = self.lm.model
        if self.chain is not None:
            seq, committed = self.chain
            self.chain = None
            logits, h = self._pairs(seq, committed)
        else:
            logits, h = model.mtp_step(self._ids(feed), self.hidden, self.cache)
        self.hidden = h[:, -1:]
        return logits[0, -1]

    # ---- self-description ---------------------------------------------------------------------------------

    @classmethod
    def planned(cls, draft, target_cfg, device: torch.device, dtype: torch.dtype, context: int,
                window: int | None = None) -> list:
        """The MTP layer's keys and values and the target's hidden states it reads (its weights are the target's)."""
        if not target_cfg.mtp_layers:
            return []
        kv = 2 * target_cfg.kv_heads_of(target_cfg.n_layers - 1) * target_cfg.head_dim * context * 2
        return [memory.Item("draft KV cache", kv + context * target_cfg.dim * 2,
                            f"{context} positions: the MTP layer's keys and values, the target's hidden states")]

    def cache_bytes(self) -> int:
        return self.cache.nbytes() + (self.target_cache.hidden.numel() * self.target_cache.hidden.element_size()
                                      if self.target_cache is not None and self.target_cache.hidden is not None else 0)

    @torch.inference_mode()
    def pass_seconds(self, prompt: list[int], reps: int = 3) -> float:
        """Median seconds of one chained MTP step after prompt."""
        from quickdraft.runtime.timing import median_seconds

        model = self.lm.model
        cache = KVCache(model.mtp.kv_layout(), len(prompt) + 2, dtype=model.dtype, device=self.device)
        hidden = torch.zeros(1, 1, self.lm.config.dim, dtype=model.dtype, device=self.device)
        ids = torch.tensor([prompt[-1:]], device=self.device)
        model.mtp_step(ids, hidden, cache)
        return median_seconds(lambda: model.mtp_step(ids, hidden, cache), self.device, reps, lambda: cache.rollback(1))

    @torch.inference_mode()
    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Greedy replay: at each position t the chain run as a round would run it (the target's hidden states of
        the known sequence, one teacher-forced target pass), counting how many of its guesses match the output
        (base.replay_chain: past a wrong guess too, for a tree's choice of position)."""
        seq = prompt + output
        model = self.lm.model
        target = KVCache.for_model(model, len(seq) + self.lm.chunk)
        target.keep_hidden(self.lm.config.dim)
        self.lm.prefill(torch.tensor([seq[:-1]], device=self.device), target)  # (its hidden states)
        out = [Offer("", 0, 0)]
        for t in range(1, len(output)):
            committed = len(prompt) + t - 1  # positions the target has run when output[t - 1] is pending
            cache = KVCache(model.mtp.kv_layout(), len(seq) + kmax + 1, dtype=model.dtype, device=self.device)
            state = {}

            def step(token: int) -> torch.Tensor:
                if not state:  # the pairs up to the pending token
                    state["logits"], state["h"] = model.mtp_step(
                        torch.tensor([seq[1:committed + 1]], device=self.device), target.hidden[:committed][None],
                        cache)
                else:
                    state["logits"], state["h"] = model.mtp_step(torch.tensor([[token]], device=self.device),
                                                                 state["h"][:, -1:], cache)
                return state["logits"][0, -1]

            out.append(replay_chain("mtp", step, output[t - 1], output[t:], kmax, self.p_min))
        return out

    @staticmethod
    def replay_round(source: str, drafted: int, stopped_early: bool, kept: int, behind: int) -> tuple[int, int]:
        """One MTP pass per drafted token (its first takes in the pairs not yet seen along), one more for the pass
        that found it unsure."""
        if source != "mtp":
            return 0, behind + kept + 1
        return drafted + stopped_early, 1
