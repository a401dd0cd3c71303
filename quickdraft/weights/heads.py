"""What loading a drafter built over the target's states shares (DFlash, DSpark: weights/dflash.py; EAGLE-3:
weights/eagle3.py): its tensors placed into its module in a runtime format, and a draft vocabulary's map onto the
target's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from quickdraft.errors import QuickdraftError
from quickdraft.models.transformer import Linear
from quickdraft.quant import placement


def place(model: nn.Module, tensors: dict, path: Path, weights: str, dtype: torch.dtype, device,
          keep_float: tuple[str, ...] = ()) -> None:
    """tensors (named as the model's parameters, every one present) into model (built on the meta device), each
    shape checked against its config's; linear layers in `weights` (quant.FORMATS: int8 / int4 where their kernels
    take the shape) but those under the top-level modules keep_float, which stay in dtype."""
    for owner, module in dict(model.named_modules()).items():
        own = {leaf: tensors[f"{owner}.{leaf}" if owner else leaf] for leaf, p in module._parameters.items()
               if p is not None}
        if not own:
            continue
        for leaf, w in own.items():
            want = tuple(module._parameters[leaf].shape)
            if tuple(w.shape) != want:
                raise QuickdraftError(f"{path}: {owner}.{leaf} has shape {tuple(w.shape)}, its config makes it {want}")
        kind = placement.linear_kind(weights, owner, {})
        if isinstance(module, Linear) and kind != placement.FLOAT and owner.split(".")[0] not in keep_float:
            layer = placement.layer(kind, own["weight"].to(dtype), own.get("bias"), device)
            if layer is not None:
                parent, _, attr = owner.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, layer)
                continue
        for leaf, w in own.items():
            module._parameters[leaf] = nn.Parameter(w.to(device, dtype), requires_grad=False)


def draft_ids(path: Path, d2t: torch.Tensor | None, draft_vocab: int, vocab: int) -> torch.Tensor:
    """The target id of each of a drafter's draft_vocab tokens (draft id i -> i + d2t[i]), checked to be distinct ids
    of the target's vocab."""
    if d2t is None or tuple(d2t.shape) != (draft_vocab,):
        raise QuickdraftError(f"{path}: a drafter of {draft_vocab} draft tokens needs d2t ({draft_vocab} offsets to "
                              "the target's ids) in its weights")
    ids = torch.arange(draft_vocab) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(set(ids.tolist())) != draft_vocab:
        raise QuickdraftError(f"{path}: its d2t does not map its {draft_vocab} draft tokens onto distinct ids of the "
                              f"target's {vocab}: the drafter's vocabulary map is broken")
    return ids
