"""A cheaper draft step: the draft model's output head over part of its vocabulary (`--draft-vocab N`).

A small draft's head is a large share of its step (the 0.5B Qwen2.5's 151,936 rows of 896: about a fifth of
it on the CPU). The drafter can score a subset of the rows instead: the first N ids (BPE vocabularies number
their tokens in merge order, so the first ones are the commonest byte pairs: English words, code, punctuation,
runs of whitespace) and every id of the prompt and of the answer so far (where the tokens of a Chinese text,
which such vocabularies add at high ids, come from). It stays exact: the target verifies every drafted token,
and a sampled draft's distribution is the one its tokens were drawn from (zero outside the subset). What it can
cost is acceptance, wherever the target's next token is outside the subset; `tune` replays both heads over the
same outputs and keeps the subset only where the pair gets faster.

Where the answer's tokens keep falling outside the subset (a Chinese answer's words, each new one a miss until it
joins), a miss ends a round the whole head might have carried on, and the saving, the head's share of a drafted
token (a fifth on the 0.5B), no longer pays: measured on the bundled prompts, answers whose tokens missed 2% and 7%
of the time drafted 4-5% faster, those at 12% and 19% up to 20% slower. So once MISS_MIN answer tokens are in, a
generation whose misses exceed MISS_MAX drafts with the whole head from then on.

Rows are taken in whole tiles of the CPU kernels' layout (vnni.TILE rows interleave there), so a quantized head's
codes are copied, never refitted: the subset's logits are the full head's, bit for bit, at the rows it has.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from quickdraft.errors import QuickdraftError
from quickdraft.quant.int4 import Int4Linear
from quickdraft.quant.int8 import Int8Linear
from quickdraft.quant.vnni import TILE

MISS_MIN = 24  # answer tokens seen before the miss rate is judged
MISS_MAX = 0.08  # misses per answer token above which the generation drafts with the whole head


def take_rows(layer, rows: torch.Tensor):
    """A module computing `layer`'s outputs at `rows` (flat indices in whole tiles for a quantized layer), its
    weights copied as they are; None where the layer's layout cannot be sliced (PyTorch's opaque int4 packing,
    the GPU's)."""
    if isinstance(layer, (Int4Linear, Int8Linear)):
        if not layer.vnni:
            return None
        names = ("packed", "scales", "lows") if isinstance(layer, Int4Linear) else ("q", "scales")
        sub = copy.copy(layer)  # the same kind of layer, with buffers of its own
        sub._buffers = {name: layer._buffers[name][rows].contiguous() for name in names}
        sub._parameters = dict(layer._parameters)
        if layer.bias is not None:
            sub.bias = nn.Parameter(layer.bias[rows], requires_grad=False)
        sub.out_features = rows.numel()
        return sub
    weight = layer.weight if isinstance(layer, (nn.Linear, nn.Embedding)) else None
    if weight is None or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    from quickdraft.models.transformer import Linear

    sub = Linear(weight.shape[1], rows.numel(), bias=False, device=weight.device, dtype=weight.dtype)
    sub.weight.data = weight[rows].contiguous()
    sub.requires_grad_(False)
    return sub


class SubsetHead:
    """The draft's head over its first `base` ids and the prompt's and answer's ids (add them as they come)."""

    def __init__(self, model, base: int, shared: int):
        """model: the draft's Transformer; shared: the ids the target shares (no other is ever scored)."""
        self.layer = model.output if model.output is not None else model.tok_embeddings
        self.quantized = isinstance(self.layer, (Int4Linear, Int8Linear))
        self.softcap = model.cfg.final_softcap
        self.shared = shared
        self.device = model.device
        self.base = min(-(-base // TILE) * TILE, shared // TILE * TILE)
        self.base_layer = take_rows(self.layer, torch.arange(self.base, device=self.device))
        if self.base_layer is None:
            raise QuickdraftError(
                "{draft_vocab}: the draft's output head is in a layout that cannot be cut into rows (int4 or int8 off "
                "quickdraft's CPU kernels); drop {draft_vocab} or give the draft {draft_weights} bf16", "draft_vocab",
                "draft_weights")
        self.ids = torch.arange(self.base, device=self.device)  # the id each column of the logits stands for
        self.reset([])

    def fork(self) -> "SubsetHead":
        """Another head over the same cut rows (shared, not copied), with a subset of its own."""
        other = copy.copy(self)
        other.reset([])
        return other

    def _unit(self, token: int) -> int:
        return token // TILE if self.quantized else token

    def reset(self, tokens: list[int]) -> None:
        """A new generation: the base ids and tokens' (the prompt's)."""
        self.extra: set[int] = set()  # tiles (or ids, for a float head) past the base the subset also has
        self.extra_layer = None
        self.ids = self.ids[: self.base]
        self._columns()
        self.answered = self.missed = 0
        self.active = True  # False: this generation's misses were too many, the whole head drafts
        self.add(tokens)

    def add(self, tokens: list[int], answer: bool = False) -> None:
        """Also score these tokens' ids from now on; answer: they are the answer's, each one outside the subset
        a miss (counted against MISS_MAX)."""
        new = set()
        for t in tokens:
            unit = self._unit(t)
            missed = self.base <= t < self.shared and unit not in self.extra and unit not in new
            if missed:
                new.add(unit)
            if answer:  # judged token by token, as tune's replay (allowed) judges them
                self.answered += 1
                self.missed += missed
                if self.answered >= MISS_MIN and self.missed > MISS_MAX * self.answered:
                    self.active = False
        if not new or not self.active:
            return
        self.extra |= new
        units = torch.tensor(sorted(self.extra), device=self.device)
        rows = (units[:, None] * TILE + torch.arange(TILE, device=self.device)).flatten() if self.quantized else units
        self.extra_layer = take_rows(self.layer, rows)
        self.ids = torch.cat([self.ids[: self.base], rows])
        self._columns()

    def _columns(self) -> None:
        keep = self.ids < self.shared  # a tile's rows past the shared ids are never proposed
        self.columns, self.kept_ids = keep.nonzero()[:, 0], self.ids[keep]

    def allowed(self, prompt: list[int], output: list[int], vocab: int) -> torch.Tensor:
        """(len(output), vocab) bool: the ids the drafter scores when guessing output[t] (tune's replay): the
        base's, the prompt's and those of output[:t], in the same units as add takes them; every id once the
        misses have switched the subset off."""
        enter = torch.full((vocab,), len(output), dtype=torch.long)  # the first position an id is scored at
        enter[: self.base] = 0
        for t, token in [(0, x) for x in prompt] + [(t + 1, x) for t, x in enumerate(output)]:
            if self.base <= token < self.shared:
                first = self._unit(token) * (TILE if self.quantized else 1)
                span = slice(first, min(first + (TILE if self.quantized else 1), self.shared))
                enter[span] = torch.minimum(enter[span], torch.tensor(t))
        allowed = enter[None, :] <= torch.arange(len(output))[:, None]
        misses = torch.cumsum(torch.tensor([self.base <= x < self.shared and int(enter[x]) == t + 1
                                            for t, x in enumerate(output)]), 0)
        answered = torch.arange(1, len(output) + 1)
        tripped = ((answered >= MISS_MIN) & (misses > MISS_MAX * answered)).nonzero()
        if len(tripped):  # add learns of output[t] at the round after it: the whole head from t + 1 on
            allowed[int(tripped[0]) + 1:] = True
        return allowed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states (..., D) -> float32 logits (..., len(ids)) at the subset's ids."""
        logits = self.base_layer(x)
        if self.extra_layer is not None:
            logits = torch.cat([logits, self.extra_layer(x)], dim=-1)
        logits = logits.float()
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def scatter(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Subset logits (..., len(ids)) -> (..., vocab), -inf at every id outside the subset or past the shared."""
        out = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
        out[..., self.kept_ids] = logits[..., self.columns]
        return out
