"""A preallocated KV cache written at absolute positions: rollback is a pointer move."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, (n_layers, B, Hkv, capacity, D) each, allocated once.

    `length` is the number of valid positions. A forward pass writes its S positions at
    [length, length + S) and advances `length`; `rollback(n)` makes positions >= n invalid again
    (their stale values are simply overwritten by the next write).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *,
                 batch: int = 1, dtype=torch.float32, device="cpu"):
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, model, capacity: int | None = None, batch: int = 1) -> "KVCache":
        cfg = model.cfg
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity or model.max_context,
                   batch=batch, dtype=model.dtype, device=model.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, Hkv, S, D) at [length, length + S); return all valid keys and values."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

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
        return c.k[layer, :, :, :self.span], c.v[layer, :, :, :self.span]
