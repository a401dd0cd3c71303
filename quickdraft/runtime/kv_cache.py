"""A preallocated KV cache written at absolute positions: rollback is a pointer move. A hybrid model's
linear-attention layers keep a recurrent state instead (RecurrentState), which a rollback restores exactly."""

from __future__ import annotations

import torch

# Positions back a rollback can reach in a recurrent state: a verification of the longest draft (16) and its last
# token, and a draft model's own steps of a round. Its states after each of these positions are kept.
HISTORY = 17


class RecurrentState:
    """One linear-attention layer's state at the cache's length: the short convolution's last K - 1 inputs
    (B, K - 1, C) and the delta rule's matrix (B, H, Dk, Dv) in float32, with the states after each of the last
    HISTORY positions kept (`saved`), so that a rollback to any of them restores exactly the state plain decoding
    has there. Keeping them costs memory, not time: each step makes its state anew, and the saved ones are the same
    tensors (runtime/memory.py counts them)."""

    keep_history = True  # False (benchmarks only: scripts/bench_hybrid.py): only the last state, no rollback into a pass

    def __init__(self, batch: int, conv_dim: int, kernel: int, heads: int, k_dim: int, v_dim: int, dtype, device):
        self.shape = (batch, conv_dim, kernel, heads, k_dim, v_dim)
        self.dtype, self.device = dtype, device
        self.reset()

    def reset(self) -> None:
        batch, conv_dim, kernel, heads, k_dim, v_dim = self.shape
        self.conv = torch.zeros(batch, kernel - 1, conv_dim, dtype=self.dtype, device=self.device)
        self.ssm = torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=self.device)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {0: (self.conv, self.ssm)}

    def save(self, position: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The state after `position` tokens (it becomes the current one when it is the last a pass saves)."""
        self.conv, self.ssm = conv, ssm
        if self.keep_history:
            self.saved[position] = (conv, ssm)

    def trim(self, length: int) -> None:
        for p in [p for p in self.saved if (p < length - HISTORY and self.keep_history) or p > length]:
            del self.saved[p]

    def restore(self, length: int) -> None:
        if length not in self.saved:
            raise ValueError(f"a recurrent state cannot roll back to position {length}: it keeps the last {HISTORY} "
                             f"positions ({sorted(self.saved)})")
        self.conv, self.ssm = self.saved[length]
        self.trim(length)

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * 4


class KVCache:
    """Keys and values of every layer, each (B, Hkv, capacity, D), allocated once (layers may differ in Hkv and D:
    gemma4's full and sliding layers; a layer that shares an earlier layer's keys and values has that layer's
    tensors, and never writes them).

    `length` is the number of valid positions. A forward pass writes its S positions at
    [length, length + S) and advances `length`; `rollback(n)` makes positions >= n invalid again
    (their stale values are simply overwritten by the next write).
    """

    def __init__(self, layout: list[tuple[int, int, int]], capacity: int, *, batch: int = 1, dtype=torch.float32,
                 device="cpu", states: list | None = None):
        """layout: per layer (key/value heads, head size, the layer whose cache it uses: itself, or an earlier
        one); a linear-attention layer has 0 heads. states: per layer None, or a linear-attention layer's
        (conv channels, conv kernel, heads, key size, value size) for its RecurrentState."""
        self.states = [None if s is None else RecurrentState(batch, *s, dtype=dtype, device=device)
                       for s in (states or [])]
        self.recurrent = [s for s in self.states if s is not None]
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
        states = model.state_layout() if hasattr(model, "state_layout") else None
        return cls(model.kv_layout(), capacity or model.max_context, batch=batch, dtype=model.dtype,
                   device=model.device, states=states)

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
        return sum(t.numel() * t.element_size() for t in self.tensors()) + sum(s.nbytes() for s in self.recurrent)

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
        """Forget every position from `length` on (a recurrent state goes back to its state there)."""
        assert 0 <= length <= self.length, (length, self.length)
        for s in self.recurrent:
            s.restore(length)
        self.length = length

    def reset(self) -> None:
        self.length = 0
        for s in self.recurrent:
            s.reset()


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
