"""The draft, described: what users write after --draft (and in a request or a tune profile) is parsed once into a
Draft, and one builder turns a Draft into a drafter.

The spellings, one for each kind:

    none          no speculation
    auto          the target's own pairing: for the default target suffix decoding, then the default draft (the chain
                  suffix,MODEL), else none (ngram with --ngram)
    ngram         prompt lookup, no model
    suffix        suffix decoding: the request's prompt and answer, and what the server answered before (its history,
                  per client), no model
    mtp           the target's own multi-token-prediction layers (Qwen3.5+), fed its hidden states
    MODEL         a draft model: an alias, a .gguf file or a Hugging Face directory; a directory holding a Gemma 4
                  assistant (config.json: gemma4_assistant) is the assistant kind, fed the target's hidden states
                  and keys and values; one holding a DFlash or DFlash2 drafter (config.json: DFlashDraftModel,
                  DFlash2DraftModel) is the dflash kind, fed the target's hidden states of several layers; one
                  holding an EAGLE-3 head in vLLM's speculators format (config.json: speculators_model_type eagle3)
                  is the eagle3 kind, likewise
    ngram+MODEL   prompt lookup where it has a match, the draft model otherwise (ngram+mtp likewise)

A new kind of drafter is its own module: a Drafter subclass (speculative/base.py) that says how it is written (its
name, or the files it recognizes), loads what it runs and builds itself; and an entry in KINDS. Nothing here, nor
elsewhere in the library, switches on a kind's name (tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from quickdraft.errors import QuickdraftError
from quickdraft.speculative.assistant import AssistantDrafter
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.combined import ChainDrafter, CombinedDrafter
from quickdraft.speculative.dflash import DFlashDrafter
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.eagle3 import Eagle3Drafter
from quickdraft.speculative.mtp import MtpDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.speculative.suffix import SuffixDrafter

KINDS: dict[str, type[Drafter]] = {"chain": ChainDrafter, "suffix": SuffixDrafter,
                                   "ngram": NgramDrafter, "model": DraftModelDrafter, "mtp": MtpDrafter,
                                   "assistant": AssistantDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter}
SPELLINGS = ("none, auto, ngram, suffix, mtp (the target's own MTP layers), a draft model (alias, .gguf file or Hugging Face "
             "directory, a Gemma 4 assistant's, a DFlash drafter's or an EAGLE-3 head's too), ngram+MODEL / ngram+mtp, "
             "or a chain of them in order of preference (mtp,ngram or DIR,ngram)")


@dataclass(frozen=True)
class Draft:
    """What drafts for a target."""

    kind: str = "none"  # none | auto | chain | one of KINDS (ngram, suffix, model, mtp, assistant, dflash, eagle3)
    model: str | None = None  # kind "model": an alias, .gguf file or Hugging Face directory; "assistant", "dflash":
    # its directory
    ngram: bool = False  # prompt lookup first, the kind's drafter where it has no match (not for "ngram")
    device: str | None = None  # where a draft model runs (None: the target's device)
    weights: str = "auto"  # a draft model's weight format (quant.FORMATS; auto: int4 on the CPU kernels)
    parts: tuple["Draft", ...] = ()  # kind "chain": its drafters, in order (each round the first that proposes)

    @classmethod
    def parse(cls, text: str, ngram: bool = False, device: str | None = None, weights: str = "auto") -> "Draft":
        """A draft from its spelling; ngram=True (the --ngram flag) puts prompt lookup in front of a model."""
        text = text.strip()
        if "," in text and not Path(text).expanduser().exists():
            return cls._chain(text, ngram, device, weights)
        if text.startswith("ngram+"):
            text, ngram = text[len("ngram+"):], True
        elif text.endswith("+ngram"):
            raise QuickdraftError(f"draft {text!r}: write ngram+{text[:-len('+ngram')]} (n-gram lookup goes first)")
        if not text:
            raise QuickdraftError(f"an empty draft: give {SPELLINGS}")
        if text == "none" and ngram:
            raise QuickdraftError("{ngram} puts prompt lookup in front of a draft model, and {draft} none has none: "
                                  "use {draft} ngram for lookup alone", "ngram", "draft")
        if text == "none":
            return cls(text)
        if text == "auto":
            return cls("auto", ngram=ngram, device=device, weights=weights)
        named = KINDS.get(text)
        if named is not None and named.named:
            return cls(text, ngram=ngram and not named.lookup)
        kind = next((k.kind for k in KINDS.values() if k.recognizes(text)), DraftModelDrafter.kind)
        return cls(kind, text, ngram, device, weights)

    @classmethod
    def _chain(cls, text: str, ngram: bool, device: str | None, weights: str) -> "Draft":
        parts: list[Draft] = [cls("ngram")] if ngram else []
        for spelling in text.split(","):
            part = cls.parse(spelling, device=device, weights=weights)
            if part.kind in ("none", "auto") or not spelling.strip():
                raise QuickdraftError(f"draft {text!r}: a chain holds drafters ({spelling.strip() or 'an empty one'} "
                                      "is none): give them in order of preference, e.g. mtp,ngram")
            parts += [cls("ngram"), replace(part, ngram=False)] if part.ngram else [part]
        names = [str(p) for p in parts]
        if len(set(names)) < len(names):
            raise QuickdraftError(f"draft {text!r} names a drafter twice: give each once")
        if sum(p.drafter_class.layer_states for p in parts) > 1:
            raise QuickdraftError(f"draft {text!r} chains two drafters that read the target's layer states (DFlash, "
                                  "EAGLE-3): keep one of them")
        return cls("chain", parts=tuple(parts)) if len(parts) > 1 else parts[0]

    @property
    def drafter_class(self) -> type[Drafter] | None:
        """The Drafter subclass this kind builds (None for none, and for auto until resolved)."""
        return KINDS.get(self.kind)

    def __str__(self) -> str:
        if self.kind == "chain":
            return ",".join(map(str, self.parts))
        if self.kind == "none" or getattr(self.drafter_class, "lookup", False):
            return self.kind
        body = self.kind if self.model is None else self.model
        return f"ngram+{body}" if self.ngram else body

    def resolve(self, target_source: str) -> "Draft":
        """`auto` made concrete for the target loaded from target_source (an alias or a path); other kinds as
        they are."""
        if self.kind != "auto":
            return self
        from quickdraft.weights import hub

        paired = hub.DEFAULT_PAIRS.get(hub.alias_of(target_source))
        if paired is None:
            return Draft("ngram") if self.ngram else Draft("none")
        # suffix decoding in front (it looks up the prompt and the answer as n-gram lookup does, by frequency, and
        # what was answered before: docs/performance.md measures it against lookup), the draft model where it has
        # nothing
        return Draft("chain", parts=(Draft("suffix"), Draft("model", paired, False, self.device, self.weights)))


NONE = Draft("none")


class DraftBuilder:
    """Builds the drafters of one target, loading each draft model once: bench and tune build several drafters
    over the same draft model, and a draft model is as large as a small target."""

    def __init__(self, target, engine, capacity: int, progress: bool | None = None):
        """target: the LoadedModel drafts speak for; engine: its EngineConfig (draft models take its dtype and
        options); capacity: positions of the drafters' caches."""
        self.target, self.engine, self.capacity, self.progress = target, engine, capacity, progress
        self.loaded: dict[tuple, object] = {}

    def resolve(self, draft: Draft | str) -> Draft:
        draft = Draft.parse(draft) if isinstance(draft, str) else draft
        return draft.resolve(self.target.name)

    def models(self, draft: Draft | str) -> list:
        """The LoadedModels the draft runs, loaded now (once)."""
        draft = self.resolve(draft)
        if draft.kind == "none":
            return []
        if draft.kind == "chain":
            return list(dict.fromkeys(m for part in draft.parts for m in self.models(part)))
        return KINDS[draft.kind].load(draft, self.target, lambda source, make=None: self._load(source, draft, make))

    def drafter(self, draft: Draft | str, speculation) -> Drafter | None:
        """The drafter the draft describes (None for none); QuickdraftError if it cannot speak for the target, or
        where a setting for a draft model (draft_window, draft_vocab) is given to a draft without one."""
        draft = self.resolve(draft)
        if draft.kind == "none":
            return None
        if draft.kind not in KINDS:
            raise QuickdraftError(f"unknown kind of draft {draft.kind!r}: give {SPELLINGS}")
        models = [p for p in (draft.parts if draft.kind == "chain" else (draft,)) if p.drafter_class.text_model]
        if getattr(speculation, "draft_window", None) is not None and not models:
            raise QuickdraftError(f"{{draft_window}} is the context a draft model drafts from, and {{draft}} {draft} "
                                  "has no draft model: drop {draft_window} or give a draft model", "draft_window",
                                  "draft")
        cut = getattr(speculation, "draft_vocab", 0)
        if cut and not models:
            raise QuickdraftError(f"{{draft_vocab}} cuts a draft model's output head, and {{draft}} {draft} has no "
                                  "draft model: drop {draft_vocab} or give a draft model", "draft_vocab", "draft")
        if draft.kind == "chain":
            own = speculation  # a draft model's own settings go to the draft models alone
            if cut or getattr(speculation, "draft_window", None) is not None:
                own = replace(speculation, draft_vocab=0, draft_window=None)
            return ChainDrafter([self.drafter(part, speculation if part.drafter_class.text_model else own)
                                 for part in draft.parts])
        drafter = KINDS[draft.kind].build(draft, self.target, self.models(draft), self.capacity, speculation)
        drafter.name = str(replace(draft, ngram=False))
        if draft.ngram and not draft.drafter_class.lookup:
            return CombinedDrafter(NgramDrafter(), drafter)
        return drafter

    def _load(self, source: str, draft: Draft, make=None):
        """A draft model in the target's dtype, on the draft's device (else the target's), in its own format; one the
        kind builds itself with make(dtype, weights, capacity) (Drafter.load)."""
        import torch

        from quickdraft import quant
        from quickdraft.weights.loader import load_model

        device = draft.device or str(self.target.device)
        dtype = str(self.target.model.dtype).removeprefix("torch.")
        weights = quant.resolve(draft.weights, device, getattr(torch, dtype), role="draft")
        if draft.drafter_class.layer_states and draft.weights == "auto" and weights == "int4":
            weights = "int8"  # (Drafter.layer_states)
        key = (str(Path(source).expanduser()), device, weights)
        if key not in self.loaded and make is not None:
            self.loaded[key] = make(getattr(torch, dtype), weights, self.capacity)
        if key not in self.loaded:
            config = replace(self.engine, device=device, dtype=dtype, weights=weights, max_context=self.capacity)
            self.loaded[key] = load_model(source, config, self.progress)
        return self.loaded[key]
