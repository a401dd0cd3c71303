"""A preallocated KV cache written at absolute positions: rollback is a pointer move."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, each (B, Hkv, capacity, D), allocated once (layers may differ in Hkv and D:
    gemma4's full and sliding layers; a layer that shares an earlier layer's keys and values has that layer's
    tensors, and never writes them).

    `length` is the number of valid positions. A forward pass writes its S positions at
    [length, length + S) and advances `length`; `rollback(n)` makes positions >= n invalid again
    (their stale values are simply overwritten by the next write).
    """

    def __init__(self, layout: list[tuple[int, int, int]], capacity: int, *, batch: int = 1, dtype=torch.float32,
                 device="cpu"):
        """layout: per layer (key/value heads, head size, the layer whose cache it uses: itself, or an earlier
        one)."""
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i, (heads, dim, source) in enumerate(layout):
            if source != i:
                self.k.append(self.k[source])
                self.v.append(self.v[source])
                continue
            self.k.append(torch.zeros(batch, heads, capacity, dim, dtype=dtype, device=device))
            self.v.append(torch.zeros(batch, heads, capacity, dim, dtype=dtype, device=device))
        self.owners = [source == i for i, (_, _, source) in enumerate(layout)]
        self.length = 0

    @classmethod
    def for_model(cls, model, capacity: int | None = None, batch: int = 1) -> "KVCache":
        return cls(model.kv_layout(), capacity or model.max_context, batch=batch, dtype=model.dtype,
                   device=model.device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, once (for its size)."""
        return [t for i, owner in enumerate(self.owners) if owner for t in (self.k[i], self.v[i])]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, Hkv, S, D) at [length, length + S); return all valid keys and values."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def read(self, layer: int, new: int):
        """The keys and values of layer as a pass of `new` positions sees them once that layer has written them."""
        end = self.length + new
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def at(self, positions: torch.Tensor, span: int) -> "PositionedWrites":
        """This cache as a pass at `positions` (a device tensor) writes and reads it, with shapes that do not
        depend on where the pass is (for CUDA graphs: Transformer.forward_at)."""
        return PositionedWrites(self, positions, span)

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def reset(self) -> None:
        self.length = 0


class PositionedWrites:
    """A cache seen by one pass at given positions: writes go to those positions (index_copy_, no host
    value needed), reads give the first `span` positions, which the pass masks to each row's own."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int):
        self.cache, self.positions, self.span = cache, positions, span

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        c = self.cache
        c.k[layer].index_copy_(2, self.positions, k)
        c.v[layer].index_copy_(2, self.positions, v)
        return c.k[layer][:, :, :self.span], c.v[layer][:, :, :self.span]

    def read(self, layer: int, new: int):
        c = self.cache
        return c.k[layer][:, :, :self.span], c.v[layer][:, :, :self.span]
