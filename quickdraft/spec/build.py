"""From the --draft flags to a drafter."""

from __future__ import annotations

from dataclasses import replace

import torch

from quickdraft import quant
from quickdraft.config import EngineConfig, SpecConfig
from quickdraft.spec.combined import CombinedDrafter
from quickdraft.spec.draft_model import DraftModelDrafter
from quickdraft.spec.ngram import NgramDrafter
from quickdraft.spec.vocab import check_compatible
from quickdraft.weights.loader import LoadedModel, load_model


def build_drafter(draft: str, target: LoadedModel, engine: EngineConfig, spec: SpecConfig, capacity: int,
                  draft_device: str | None = None, ngram: bool = False, progress: bool | None = None,
                  weights: str = "auto"):
    """draft: 'none', 'ngram', or a model (alias, .gguf, HF directory); ngram=True adds prompt lookup
    in front of a draft model. The draft model runs on the target's device unless draft_device says.
    weights: 'auto' (int4 where the CPU kernel applies, else the dtype's), 'bf16' (the dtype's), 'int8', 'int4'."""
    if draft == "none":
        return None
    if draft == "ngram":
        return NgramDrafter()
    draft_lm = load_draft(draft, target, engine, capacity, draft_device, progress, weights)
    check_compatible(target.tokenizer, draft_lm.tokenizer, target.config.vocab_size, draft_lm.config.vocab_size)
    return model_drafter(draft_lm, target, spec, capacity, ngram)


def draft_model_of(drafter) -> DraftModelDrafter | None:
    """The draft model inside a drafter (alone or behind n-gram lookup), None for n-gram lookup alone."""
    if isinstance(drafter, CombinedDrafter):
        return drafter.draft
    return drafter if isinstance(drafter, DraftModelDrafter) else None


def model_drafter(draft_lm: LoadedModel, target: LoadedModel, spec: SpecConfig, capacity: int, ngram: bool):
    drafter = DraftModelDrafter(draft_lm.model, target.config.vocab_size, capacity, spec.p_min)
    return CombinedDrafter(NgramDrafter(), drafter) if ngram else drafter


def load_draft(draft: str, target: LoadedModel, engine: EngineConfig, capacity: int, draft_device: str | None = None,
               progress: bool | None = None, weights: str = "auto") -> LoadedModel:
    """The draft model, in the target's dtype, on draft_device or the target's device."""
    device = draft_device or str(target.device)
    dtype = str(target.model.dtype).removeprefix("torch.")
    weights = quant.resolve(weights, device, getattr(torch, dtype), role="draft")
    return load_model(draft, replace(engine, device=device, dtype=dtype, weights=weights, max_context=capacity),
                      progress)


def drafter_name(draft: str, ngram: bool) -> str:
    return f"ngram+{draft}" if ngram and draft not in ("none", "ngram") else draft
