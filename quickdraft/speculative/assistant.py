"""Gemma 4's assistant drafts (`--draft DIR`, DIR a gemma4_assistant checkpoint): a small model on the target's
hidden states and keys and values (models/assistant.py).

After each target pass the engine's cache holds every position's final hidden state (KVCache.keep_hidden) and every
layer's keys and values. A round's first step feeds the assistant the pending token (the target's embedding of it)
with the target's hidden state of the position before it; each further step the token it just drafted with its own
last hidden state. Every step queries the pending token's position over the target's committed keys and values: the
assistant keeps no cache, so nothing of it is rolled back or caught up. As transformers' Gemma4AssistantCandidate-
Generator runs it, except that the keys and values it reads are exactly the committed positions' (transformers
passes the verification pass's, one position further, whose entry may be a rejected draft's).

Drafting and verification are the draft model's (DraftModelDrafter._draft): exactness is the engine's, whatever the
drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.models.assistant import TargetKeys, sources
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.base import Offer, Proposal, replay_chain
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.weights import memory


def is_assistant(source: str) -> bool:
    """Whether source is a directory holding a Gemma 4 assistant checkpoint (config.json says gemma4_assistant)."""
    config = Path(source).expanduser() / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("model_type") == \
            "gemma4_assistant"
    except (OSError, ValueError):
        return False


class AssistantDrafter(DraftModelDrafter):
    kind = "assistant"
    text_model = False

    @classmethod
    def recognizes(cls, source: str) -> bool:
        return is_assistant(source)
    sources = ("assistant",)
    samples = True
    reads_hidden = True

    def __init__(self, lm, target, p_min: float = 0.0):
        """lm: the assistant's LoadedModel; target: the LoadedModel it drafts for."""
        cfg = lm.config
        if cfg.assistant_backbone != target.config.dim:
            raise QuickdraftError(f"{lm.name} was trained for a target {cfg.assistant_backbone} wide; {target.name} is "
                                  f"{target.config.dim} wide: give the assistant made for this target")
        if cfg.vocab_size != target.config.vocab_size:
            raise QuickdraftError(f"{lm.name} scores {cfg.vocab_size} tokens, {target.name} has {target.config.vocab_size}"
                                  ": give the assistant made for this target")
        self.lm, self.target = lm, target
        self.device = lm.device
        if self.device != target.device:
            raise QuickdraftError("an assistant reads the target's keys and values: it runs on the target's device "
                                  f"({target.device}), not {self.device}")
        self.name = lm.name
        self.target_vocab = self.shared = target.config.vocab_size
        self.p_min = p_min
        self.layers = sources(lm.model, target.model)
        self.target_cache: KVCache | None = None
        self.first: int | None = None  # the round's first step: the positions committed
        self.keys: TargetKeys | None = None
        self.hidden: torch.Tensor | None = None  # the assistant's last hidden state, for the next step

    def fork(self) -> "AssistantDrafter":
        return AssistantDrafter(self.lm, self.target, self.p_min)

    @classmethod
    def load(cls, draft, target, load) -> list:
        return [load(draft.model)]

    @classmethod
    def build(cls, draft, target, models, capacity, speculation) -> "AssistantDrafter":
        (lm,) = models
        return cls(lm, target, speculation.p_min)

    def attach(self, cache: KVCache) -> None:
        cache.keep_hidden(self.target.config.dim)
        self.target_cache = cache

    def adopt(self, other: "AssistantDrafter", n: int) -> None:
        """Nothing of its own to take: it reads the slot's keys, values and hidden states."""

    def forget(self) -> None:
        self.first = self.keys = self.hidden = None

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        self.first = self.keys = self.hidden = None  # nothing of its own to prefill

    @torch.inference_mode()
    def propose(self, seq: list[int], k_for, params, generator, constraint=None, branches=None) -> Proposal:
        if self.target_cache is None or self.target_cache.hidden is None:
            raise QuickdraftError("the assistant reads the target's hidden states: build its engine with it "
                                  "(Engine(target, context, drafter))")
        committed = len(seq) - 1  # the target has run positions 0 .. committed - 1; seq[committed] is pending
        if committed < 1:
            return Proposal([], "assistant")
        self.first = committed
        return self._pending_chain(seq, k_for("assistant"), params, generator, constraint, "assistant", branches)

    def _logits(self, feed) -> torch.Tensor:
        """One step for the last token fed (a list, or the draft still on the device): the pending token with the
        target's hidden state before it on a round's first step, the token just drafted with the assistant's own
        hidden state after."""
        if self.first is not None:
            committed, self.first = self.first, None
            self.keys = TargetKeys(self.target_cache, self.layers, committed)
            self.hidden = self.target_cache.hidden[committed - 1].view(1, 1, -1)
        return self._step(feed[-1:])[0, -1]

    def _step(self, token) -> torch.Tensor:
        """token: an id, a list of one, or one on the device."""
        embedded = self.target.model.embed(self._ids(token if not isinstance(token, int) else [token]))
        logits, self.hidden = self.lm.model.step(embedded, self.hidden, self.keys, self.keys.committed)
        return logits

    # ---- self-description ---------------------------------------------------------------------------------

    @property
    def max_draft(self) -> int | None:
        return None

    @classmethod
    def planned(cls, draft, target_cfg, device: torch.device, dtype: torch.dtype, context: int,
                window: int | None = None) -> list:
        """Its weights and one pass's activations where it shares the target's card, and the target's hidden states
        it reads (its keys and values are the target's)."""
        spec = cls.planned_model(draft, device, dtype)
        mine = [] if spec is None else cls.planned_weights(spec, device) + [
            memory.Item("activations", memory.activation_bytes(spec.cfg, context))]
        return mine + [memory.Item("draft KV cache", context * target_cfg.dim * 2,
                                   f"{context} positions: the target's hidden states the assistant reads")]

    def cache_bytes(self) -> int:
        cache = self.target_cache
        return cache.hidden.numel() * cache.hidden.element_size() if cache is not None and cache.hidden is not None \
            else 0

    @torch.inference_mode()
    def pass_seconds(self, prompt: list[int], reps: int = 3) -> float:
        """Median seconds of one assistant step over a target cache of the prompt's length."""
        from quickdraft.runtime.timing import median_seconds

        target = self.target.model
        cache = KVCache.for_model(target, len(prompt) + 2)
        cache.length = len(prompt)
        self.keys = TargetKeys(cache, self.layers, len(prompt))
        hidden = torch.zeros(1, 1, self.target.config.dim, dtype=target.dtype, device=self.device)

        def one():
            self.hidden = hidden
            self._step(prompt[-1])

        return median_seconds(one, self.device, reps)

    @torch.inference_mode()
    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """Greedy replay: at each position t the chain a round would run (the target's hidden states, keys and
        values of the known sequence, one teacher-forced target pass), counting how many of its guesses match."""
        seq = prompt + output
        target = KVCache.for_model(self.target.model, len(seq) + self.target.chunk)
        target.keep_hidden(self.target.config.dim)
        self.target.prefill(torch.tensor([seq[:-1]], device=self.device), target)  # (its states)
        out = [Offer("", 0, 0)]
        for t in range(1, len(output)):
            committed = len(prompt) + t - 1  # positions the target has run when output[t - 1] is pending
            self.keys = TargetKeys(target, self.layers, committed)
            self.hidden = target.hidden[committed - 1].view(1, 1, -1)
            out.append(replay_chain("assistant", lambda token: self._step(token)[0, -1], output[t - 1], output[t:],
                                    kmax, self.p_min))
        return out

    @staticmethod
    def replay_round(source: str, drafted: int, stopped_early: bool, kept: int, behind: int) -> tuple[int, int]:
        """One assistant step per drafted token, one more for the step that found it unsure; it keeps nothing of
        the sequence, so it is never behind."""
        if source != "assistant":
            return 0, 0
        return drafted + stopped_early, 0
