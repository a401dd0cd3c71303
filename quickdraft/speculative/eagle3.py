"""EAGLE-3 heads draft (`--draft DIR`, DIR holding one in vLLM's speculators format: speculators_model_type
"eagle3"), fed the target's hidden states of a few layers.

The engine's cache keeps, at every position the target has run, the outputs of the target layers the head reads
(KVCache.keep_features). Each round the head first takes in the pairs it has not seen (the target's states at p, token
p + 1, for every committed p) in one pass; the last pair's logits guess the first draft. A chain follows, each
further draft from the head's own output and the token it just drafted; the chained entries of its cache are dropped
after the round (they rest on its own guesses, not on the target's states), as the MTP drafter's are. Its logits
cover its draft vocabulary: each draft token is the target token d2t maps it to, and every other target token scores
OUTSIDE below the lowest (never drawn at any temperature a sampler uses, yet finite where a grammar allows none of
the head's tokens). Drafting and verification are the draft model's (DraftModelDrafter._draft: greedy, seeded or
sampled, masked by a grammar, stopped early below --draft-p-min): exactness is the engine's, whatever the drafts.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import common_prefix
from quickdraft.speculative.base import Offer, Proposal, replay_chain
from quickdraft.speculative.dflash import OUTSIDE, HeadModel
from quickdraft.speculative.draft_model import CATCH_UP, DraftModelDrafter
from quickdraft.weights import eagle3 as eagle3_files, memory

is_eagle3 = eagle3_files.is_eagle3


class Eagle3Drafter(DraftModelDrafter):
    kind = "eagle3"
    text_model = False
    layer_states = True

    @classmethod
    def recognizes(cls, source: str) -> bool:
        return is_eagle3(source)
    sources = ("eagle3",)
    samples = True
    reads_hidden = True

    def __init__(self, head: HeadModel, target, capacity: int, p_min: float = 0.0):
        eagle3_files.check_target(head.config, head.name, target)
        if head.device != target.device:
            raise QuickdraftError(f"an EAGLE-3 head reads the target's hidden states: it runs on the target's device "
                                  f"({target.device}), not {head.device}")
        self.head, self.target = head, target
        self.lm = head  # what DraftModelDrafter's helpers call the model
        self.device = target.device
        self.name = head.name
        self.target_vocab = self.shared = target.config.vocab_size
        self.p_min = p_min
        self.capacity = capacity
        self.cache = KVCache(head.model.kv_layout(), capacity, dtype=head.model.dtype, device=self.device)
        self.target_cache: KVCache | None = None
        self.chain: tuple[list[int], int] | None = None  # the round's first pass: (sequence, positions committed)
        self.hidden: torch.Tensor | None = None  # the head's last output, for the next chained step
        self.seen: list[int] = []  # the sequence its cache's pairs came from (entry p: tokens up to p + 1)

    def fork(self) -> "Eagle3Drafter":
        return Eagle3Drafter(self.head, self.target, self.capacity, self.p_min)

    @classmethod
    def load(cls, draft, target, load) -> list:
        return [load(draft.model, lambda dtype, weights, capacity: load_head(draft.model, target, dtype, weights,
                                                                             capacity))]

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "Eagle3Drafter":
        (head,) = models
        return cls(head, target, capacity, speculation.p_min)

    @property
    def models(self) -> tuple:
        return ()  # not a LoadedModel: its bytes are counted beside its cache (cache_bytes)

    def attach(self, cache: KVCache) -> None:
        self._keep(cache)
        self.target_cache = cache

    def _keep(self, cache: KVCache) -> None:
        cache.keep_features(list(self.head.config.target_layers), self.target.config.dim)

    def adopt(self, other: "Eagle3Drafter", n: int) -> None:
        """Its entry p pairs the target's states at p with token p + 1: those of the first n tokens are other's
        first n - 1."""
        self.cache.copy_prefix(other.cache, min(other.cache.length, max(n - 1, 0)))
        self.seen = list(other.seen[:n])

    def forget(self) -> None:
        self.cache.reset()
        self.seen = []

    def lag(self, seq: list[int], source: str) -> int:
        return 0  # the pairs it has not taken in ride along its first pass

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        """Nothing to prefill: the prompt's pairs go in with the first round's first pass. Pairs of the slot's last
        generation that the prompt begins with are kept."""
        self.cache.rollback(min(self.cache.length, max(common_prefix(self.seen, prompt) - 1, 0)))
        self.seen = list(prompt)

    def _pairs(self, seq: list[int], end: int, last_only: bool = True):
        """The pairs (the target's states at p, seq[p + 1]) for p from the cache's length to end, in one pass."""
        start = self.cache.length
        model = self.head.model
        return model.step(self._embedded(seq[start + 1:end + 1]),
                          model.project(self.target_cache.features[start:end]), self.cache, last_only)

    def _embedded(self, ids) -> torch.Tensor:
        """Token rows as the head reads them: its own table, else the target's raw one."""
        ids = torch.as_tensor(ids, device=self.device).view(-1)
        model = self.head.model
        if model.embed_tokens is not None:
            return model.embed_tokens(ids)
        return self.target.model.tok_embeddings(ids)

    @torch.inference_mode()
    def propose(self, seq: list[int], k_for, params, generator, constraint=None, branches=None) -> Proposal:
        if self.target_cache is None or self.target_cache.features is None:
            raise QuickdraftError("an EAGLE-3 head reads the target's hidden states: build its engine with it "
                                  "(Engine(target, context, drafter))")
        k = k_for("eagle3")
        committed = len(seq) - 1  # the target has run positions 0 .. committed - 1; seq[committed] is pending
        if k <= 0 or committed < 1:
            return Proposal([], "eagle3")
        same = len(seq) if self.seen is seq else common_prefix(self.seen, seq)  # (the engine's list only grows)
        self.cache.rollback(min(self.cache.length, max(same - 1, 0), committed - 1))  # (the last pair's logits: again)
        self.seen = seq
        catch_up_s = 0.0
        if committed - self.cache.length > CATCH_UP:  # after plain steps or other drafters' rounds: timed apart
            t0 = time.perf_counter()
            self._pairs(seq, committed - 1)
            catch_up_s = time.perf_counter() - t0
        self.chain = (seq, committed)
        try:
            return self._pending_chain(seq, k, params, generator, constraint, "eagle3", branches, catch_up_s)
        finally:
            self.chain = None
            self.cache.rollback(min(committed, self.cache.length))  # chained entries rest on the head's guesses

    def _logits(self, feed) -> torch.Tensor:
        """The first call of a round: the pairs not yet seen, up to the pending token; then one chained step for
        the token just drafted (feed: a list, or the draft still on the device). Logits over the target's
        vocabulary (V,)."""
        if self.chain is not None:
            seq, committed = self.chain
            self.chain = None
            logits, h = self._pairs(seq, committed)
        else:
            logits, h = self.head.model.step(self._embedded(self._ids(feed)[0, -1:]), self.hidden, self.cache)
        self.hidden = h[-1:]
        return self._over_target(logits[-1])

    def _over_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (draft vocab,) -> (target vocab,): each at the target id d2t maps it to, every
        other OUTSIDE below the lowest."""
        ids = self.head.model.target_ids
        if logits.shape[-1] == self.target_vocab and ids.shape[0] == self.target_vocab:
            return logits  # the whole vocabulary, in order
        out = (logits.min() - OUTSIDE).expand(self.target_vocab).clone()
        return out.scatter_(0, ids, logits)

    # ---- self-description ---------------------------------------------------------------------------------

    @property
    def max_draft(self) -> int | None:
        return None

    @property
    def cut_head(self) -> bool:
        return False

    @classmethod
    def planned(cls, draft, target_cfg, device: torch.device, dtype: torch.dtype, context: int,
                window: int | None = None) -> list:
        """Its weights (on the target's device, at most in its dtype), its keys and values of the context and the
        target's hidden states of the layers it reads, in bf16."""
        path = Path(draft.model).expanduser()
        cfg = eagle3_files.read_config(path)
        size = torch.empty(0, dtype=dtype).element_size()
        kv = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
        features = len(eagle3_files.for_target(cfg, target_cfg.n_layers).aux_layers) * target_cfg.dim * 2
        return [memory.Item("draft weights", eagle3_files.weight_bytes(path, size),
                            f"{path.name}, at most {str(dtype).removeprefix('torch.')}"),
                memory.Item("draft KV cache", context * (kv + features),
                            f"{context} positions: its keys and values, the target's hidden states of "
                            f"{features // (target_cfg.dim * 2)} layers")]

    def cache_bytes(self) -> int:
        features = self.target_cache.features if self.target_cache is not None else None
        return self.cache.nbytes() + (features.numel() * features.element_size() if features is not None else 0)

    @torch.inference_mode()
    def pass_seconds(self, prompt: list[int], reps: int = 3) -> float:
        """Median seconds of one chained step after prompt."""
        from quickdraft.runtime.timing import median_seconds

        model = self.head.model
        cache = KVCache(model.kv_layout(), len(prompt) + 2, dtype=model.dtype, device=self.device)
        hidden = torch.zeros(1, self.target.config.dim, dtype=model.dtype, device=self.device)
        embedded = self._embedded(prompt[-1:])
        model.step(embedded, hidden, cache)
        return median_seconds(lambda: model.step(embedded, hidden, cache), self.device, reps,
                              lambda: cache.rollback(1))

    @torch.inference_mode()
    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Greedy replay: the target's states of the known sequence (one teacher-forced target pass), then at each
        position t the chain a round would run there (base.replay_chain)."""
        seq = prompt + output
        target = KVCache.for_model(self.target.model, len(seq) + self.target.chunk)
        self._keep(target)
        self.target.prefill(torch.tensor([seq[:-1]], device=self.device), target)  # (its states)
        out = [Offer("", 0, 0)]
        saved = self.target_cache, self.cache, self.seen
        try:
            self.target_cache = target
            self.cache = KVCache(self.head.model.kv_layout(), len(seq) + kmax + 1, dtype=self.head.model.dtype,
                                 device=self.device)
            for t in range(1, len(output)):
                committed = len(prompt) + t - 1  # positions the target has run when output[t - 1] is pending
                self.cache.rollback(min(self.cache.length, committed - 1))
                self.chain = (seq, committed)
                out.append(replay_chain("eagle3", lambda token: self._logits([token]), seq[committed], output[t:],
                                        kmax, self.p_min))
                self.chain = None
        finally:
            self.target_cache, self.cache, self.seen = saved
        return out

    @staticmethod
    def replay_round(source: str, drafted: int, stopped_early: bool, kept: int, behind: int) -> tuple[int, int]:
        """One pass per drafted token (its first takes in the pairs not yet seen along), one more for the pass that
        found it unsure."""
        if source != "eagle3":
            return 0, behind + kept + 1
        return drafted + stopped_early, 1


def load_head(source: str, target, dtype: torch.dtype, weights: str, capacity: int) -> HeadModel:
    """The EAGLE-3 head in directory `source`, for `target` (a LoadedModel), on the target's device."""
    path = Path(source).expanduser()
    eagle3_files.check_target(eagle3_files.read_config(path), path.name, target)
    return HeadModel.load(path, weights, lambda: eagle3_files.load(path, capacity, dtype, target.device, weights,
                                                                   target.config.n_layers))
