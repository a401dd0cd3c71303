"""A guard for the hot paths that works on any device: it records what would make a CUDA pass wait for the host or
copy from it, so a CPU test can catch what only a GPU would feel (a broken graph capture, a sync per token).

- read-backs: a tensor's value read on the host (item, int(), float(), bool(), tolist, numpy, cpu) or an op whose
  output size depends on values (nonzero, unique, masked_select, boolean indexing): on CUDA each waits for the device;
- copies in: a tensor made from Python data for a device (torch.tensor(list, device=...)): on CUDA a host-to-device
  copy, which a CUDA graph capture refuses.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu", "nonzero",
                   "unique", "masked_select", "equal"})
MAKERS = frozenset({"tensor", "as_tensor"})


class HostTraffic(TorchFunctionMode):
    """Records (kind, op, where) for each read-back and copy-in while active: `with HostTraffic() as traffic: ...`,
    then traffic.reads, traffic.copies."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.copies: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name == "__getitem__" and _boolean_index(args)):
            self.reads.append((name, _where()))
        elif name in MAKERS and "device" in kwargs and not isinstance(args[0] if args else None, torch.Tensor):
            self.copies.append((name, _where()))
        return func(*args, **kwargs)


def _boolean_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _where() -> str:
    """The innermost frame of quickdraft's own code that made the call."""
    frames = [f for f in traceback.extract_stack() if "/quickdraft/" in f.filename and "/tests/" not in f.filename]
    return f"{frames[-1].filename.rsplit('/quickdraft/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
