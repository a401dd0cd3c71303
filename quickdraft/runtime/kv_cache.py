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
    has there. The matrices live in HISTORY + 2 preallocated slots: a step writes its new state into a free slot
    (`fresh`) and a rollback points back at an older one, so keeping them costs memory (weights/memory.py counts
    it), neither copies nor allocations."""

    keep_history = True  # False (benchmarks only: scripts/bench_hybrid.py): only the last state, no rollback into a pass

    def __init__(self, batch: int, conv_dim: int, kernel: int, heads: int, k_dim: int, v_dim: int, dtype, device):
        self.shape = (batch, conv_dim, kernel, heads, k_dim, v_dim)
        self.dtype, self.device = dtype, device
        self.slots = torch.zeros(HISTORY + 2, batch, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.reset()

    def reset(self) -> None:
        batch, conv_dim, kernel, heads, k_dim, v_dim = self.shape
        self.slots[0].zero_()
        self.conv = torch.zeros(batch, kernel - 1, conv_dim, dtype=self.dtype, device=self.device)
        self.current = 0
        self.saved: dict[int, tuple[torch.Tensor, int]] = {0: (self.conv, 0)}

    @property
    def ssm(self) -> torch.Tensor:
        return self.slots[self.current]

    def fresh(self) -> tuple[int, torch.Tensor]:
        """A slot no kept state (nor the current one) is in: (its index, its tensor) for the next state."""
        used = {index for _, index in self.saved.values()} | {self.current}
        index = next(i for i in range(len(self.slots)) if i not in used)
        return index, self.slots[index]

    def save(self, position: int, conv: torch.Tensor, index: int) -> None:
        """The state after `position` tokens, its matrix in slot `index` (it becomes the current state)."""
        self.conv, self.current = conv, index
        if self.keep_history:
            self.saved[position] = (conv, index)
            self.saved.pop(position - HISTORY - 1, None)  # within a long pass too: HISTORY + 1 kept, a slot free

    def trim(self, length: int) -> None:
        for p in [p for p in self.saved if (p < length - HISTORY and self.keep_history) or p > length]:
            del self.saved[p]

    def restore(self, length: int) -> None:
        if length not in self.saved:
            raise ValueError(f"a recurrent state cannot roll back to position {length}: it keeps the last {HISTORY} "
                             f"positions ({sorted(self.saved)})")
        self.conv, self.current = self.saved[length]
        self.trim(length)

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.slots.numel() * 4

    def snapshot(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the state after `position` tokens (one it keeps): (convolution inputs, matrix)."""
        conv, index = self.saved[position]
        return conv.clone(), self.slots[index].clone()

    def load(self, position: int, snapshot: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Make a snapshot the state after `position` tokens (its history starts over there)."""
        conv, ssm = snapshot
        self.slots[0].copy_(ssm)
        self.conv, self.current = conv.clone(), 0
        self.saved = {position: (self.conv, 0)}


class KVCache:
    """Keys and values of every layer, each (B, Hkv, capacity, D), allocated once (layers may differ in Hkv and D:
    gemma4's full and sliding layers; a layer that shares an earlier layer's keys and values has that layer's
    tensors, and never writes them).

    `length` is the number of valid positions. A forward pass writes its S positions at
    [length, length + S) and advances `length`; `rollback(n)` makes positions >= n invalid again
    (their stale values are simply overwritten by the next write).

    A draft model's cache may hold a window of its sequence (`compact`): its first positions (sinks), then the recent
    ones, each index i past the sinks standing for position i + `offset`. Keys keep the rotary of their own position,
    so each query attends to them as at their true distance; the positions between are simply not there.
    """

    def __init__(self, layout: list[tuple[int, int, int]], capacity: int, *, batch: int = 1, dtype=torch.float32,
                 device="cpu", states: list | None = None):
        """layout: per layer (key/value heads, head size, the layer whose cache it uses: itself, or an earlier
        one); a linear-attention layer has 0 heads. states: per layer None, or a linear-attention layer's
        (conv channels, conv kernel, heads, key size, value size) for its RecurrentState."""
        self.states = [None if s is None else RecurrentState(batch, *s, dtype=dtype, device=device)
                       for s in (states or [])]
        self.hidden: torch.Tensor | None = None  # (capacity, dim): every position's final hidden state (keep_hidden)
        self.features: torch.Tensor | None = None  # (capacity, n * dim): some layers' outputs (keep_features)
        self.tree: "TreeRows | None" = None  # the last tree pass over this cache, until its path is committed
        self.feature_layers: dict[int, tuple[int, ...]] = {}  # layer -> its column blocks in features
        self.recurrent = [s for s in self.states if s is not None]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # On the CPU the keys and values are not zeroed: memory the system hands out only once it is first written
        # costs nothing until then, so a cache of a long context takes memory as it fills. A pass reads a position
        # only once it has written it, but for one with fixed shapes (a graph's: `at`), which reads a span past the
        # length under a mask: zeros there (a masked weight times a stray NaN would be NaN), written as it first reaches
        # them (`zeroed`). On CUDA the memory is taken whole anyway: zeros from the start.
        self.layout, self.shape = layout, (batch, capacity, dtype, torch.device(device))
        self.lazy = self.shape[3].type == "cpu"  # its memory is taken as positions are written (used_bytes)
        self._allocate()
        self.owners = [source == i for i, (_, _, source) in enumerate(layout)]
        self.high = 0  # the most positions it has held since it was made (or released): what its memory holds
        self._length = 0
        self.offset = 0  # positions dropped from the middle (compact): index i past the sinks is position i + offset

    def _allocate(self) -> None:
        batch, capacity, dtype, device = self.shape
        alloc = torch.empty if self.lazy else torch.zeros
        self.k, self.v = [], []
        # ordinary tensors whoever asks (a slot dropped for the budget in the middle of a step is released under
        # inference mode): inference tensors could not be written outside it, where a request starts (Batch.add)
        with torch.inference_mode(False):
            for i, (heads, dim, source) in enumerate(self.layout):
                if source != i:
                    self.k.append(self.k[source])
                    self.v.append(self.v[source])
                    continue
                self.k.append(alloc(batch, heads, capacity, dim, dtype=dtype, device=device))
                self.v.append(alloc(batch, heads, capacity, dim, dtype=dtype, device=device))
        self.zeroed = 0 if self.lazy else capacity  # positions from which on the memory may hold anything

    @property
    def length(self) -> int:
        """The number of valid positions."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self._length = value
        self.high = max(self.high, value)

    @property
    def held(self) -> int:
        """Positions whose memory it holds: the most it has held, or zeroed ahead of a masked pass."""
        return max(self.high, self.zeroed)

    def _key_bytes(self) -> int:
        """Bytes of one position's keys and values."""
        return sum(t[:, :, :1].numel() * t.element_size() for t in self.tensors())

    def position_bytes(self) -> int:
        """Bytes of the keys and values (and kept hidden states) of one position."""
        kept = sum(t[:1].numel() * t.element_size() for t in (self.hidden, self.features) if t is not None)
        return self._key_bytes() + kept

    def used_bytes(self) -> int:
        """The memory it takes now: on the CPU what the positions it has held take (the system hands memory out as
        it is first written), on a GPU all of it."""
        if not self.lazy:
            return self.nbytes()
        kept = sum(t.numel() * t.element_size() for t in (self.hidden, self.features) if t is not None)  # (whole)
        return self.held * self._key_bytes() + kept + sum(s.nbytes() for s in self.recurrent)

    def release(self) -> None:
        """Forget everything and give its keys' and values' memory back (on the CPU: taken again as it fills)."""
        self.reset()
        if self.lazy and self.held:
            self._allocate()
        self.high = 0

    @classmethod
    def for_model(cls, model, capacity: int | None = None, batch: int = 1) -> "KVCache":
        states = model.state_layout() if hasattr(model, "state_layout") else None
        return cls(model.kv_layout(), capacity or model.max_context, batch=batch, dtype=model.dtype,
                   device=model.device, states=states)

    @property
    def max_draft(self) -> int | None:
        """The most tokens a round may draft into this cache: a recurrent state rolls back at most HISTORY positions
        (a verification of k drafts, a draft model's k steps and their catch-up); None without one."""
        return HISTORY - 1 if self.recurrent else None

    def keep_hidden(self, dim: int) -> None:
        """Keep every position's final hidden state (normed) from now on, for a drafter that reads them (mtp)."""
        if self.hidden is None:
            self.hidden = torch.zeros(self.capacity, dim, dtype=self.k[0].dtype, device=self.k[0].device)

    def keep_features(self, layers: list[int], dim: int) -> None:
        """Keep every position's outputs of these layers (before the final norm; the last layer's after it, as
        transformers gives them), side by side in that order (a layer may come twice), from now on, for a drafter
        that reads them (dflash)."""
        if self.features is None:
            self.features = torch.zeros(self.capacity, len(layers) * dim, dtype=self.k[0].dtype,
                                        device=self.k[0].device)
            self.feature_layers = {layer: tuple(j for j, other in enumerate(layers) if other == layer)
                                   for layer in layers}

    def store_hidden(self, rows: torch.Tensor) -> None:
        """A pass's final hidden states (S, dim), at its positions [length, length + S)."""
        self.hidden[self.length:self.length + rows.shape[0]] = rows

    def store_feature(self, layer: int, rows: torch.Tensor) -> None:
        """A pass's outputs (S, dim) of a kept layer, at its positions [length, length + S)."""
        dim = rows.shape[-1]
        for j in self.feature_layers[layer]:
            self.features[self.length:self.length + rows.shape[0], j * dim:(j + 1) * dim] = rows

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
        if span > self.zeroed:  # (below the length every position was written: finite, whatever it holds)
            start = max(self.zeroed, self.length)
            for t in self.tensors():
                t[:, :, start:span].zero_()
            self.zeroed = span
        return PositionedWrites(self, positions, span)

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on (a recurrent state goes back to its state there)."""
        assert 0 <= length <= self.length, (length, self.length)
        for s in self.recurrent:
            s.restore(length)
        self.length = length

    @property
    def position(self) -> int:
        """The position the next pass's first row is at (its index is `length`)."""
        return self.length + self.offset

    def compact(self, sinks: int, start: int, offset: int) -> None:
        """Drop the indices [sinks, start) and move the rest down behind the sinks (a copy, no pass), `offset` being
        the positions dropped in all from now on (a windowed draft: speculative/draft_model.py). Not for recurrent
        states, whose history is not positions."""
        assert not self.recurrent and sinks <= start <= self.length and offset >= self.offset
        n = self.length - start
        if n and start > sinks:
            for t in self.tensors():
                t[:, :, sinks:sinks + n] = t[:, :, start:start + n].clone()
        self.length, self.offset = sinks + n, offset

    def reset(self) -> None:
        self.length = 0
        self.offset = 0
        self.tree = None  # (a tree pass whose path was never kept: what it held of its leaves goes too)
        for s in self.recurrent:
            s.reset()

    def snapshot(self, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The recurrent states after `position` tokens (a position they keep), copied: a checkpoint."""
        return [s.snapshot(position) for s in self.recurrent]

    def restore_snapshot(self, position: int, snapshot: list) -> None:
        """Return to a checkpoint: the recurrent states it holds, the keys and values before `position` (which
        must still hold the same tokens)."""
        assert 0 <= position <= self.capacity and len(snapshot) == len(self.recurrent)
        for s, state in zip(self.recurrent, snapshot):
            s.load(position, state)
        self.length = position

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Take other's first n positions: keys and values (and hidden states) copied; recurrent states are the
        caller's (restore_snapshot). Both caches of one model."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine[:, :, :n].copy_(theirs[:, :, :n])
        if self.hidden is not None and other.hidden is not None:
            self.hidden[:n].copy_(other.hidden[:n])
        if self.features is not None and other.features is not None:
            self.features[:n].copy_(other.features[:n])
        self.length, self.offset = n, 0

    def _by_position(self) -> list[tuple[torch.Tensor, int]]:
        """Each tensor it holds per position, with its position dimension: keys and values, kept hidden states."""
        return [(t, 2) for t in self.tensors()] + [(t, 0) for t in (self.hidden, self.features) if t is not None]

    def export_prefix(self, n: int) -> list[torch.Tensor]:
        """Copies in host memory of its first n positions (keys and values, and hidden states where it keeps them):
        what import_prefix takes back (runtime/slots.HostCopies). Pageable, not pinned: PyTorch's pinned allocator
        rounds each block up and keeps what is freed, which --cache-ram would not count."""
        return [t.narrow(dim, 0, n).to("cpu", copy=True) for t, dim in self._by_position()]

    def import_prefix(self, copies: list[torch.Tensor], n: int) -> None:
        """Take back the first n positions of copies export_prefix made of a cache of this model (n or more)."""
        parts = self._by_position()
        if len(parts) != len(copies):
            raise ValueError("the copy is not of this cache's layout")
        pairs = [(t.narrow(dim, 0, n), c.narrow(dim, 0, n)) for (t, dim), c in zip(parts, copies)]
        if any(mine.shape != theirs.shape for mine, theirs in pairs):
            raise ValueError("the copy is not of this cache's layout")
        self.reset()
        for mine, theirs in pairs:
            mine.copy_(theirs)  # (blocking: the copy may be freed as soon as this returns)
        self.length, self.offset = n, 0


class Segments:
    """Several sequences' caches seen by one pass (Transformer.forward_segments): the pass's rows are theirs in order,
    `sizes[i]` rows at caches[i].length on. The layers split the rows by sequence where a sequence's own state is
    involved (attention over its cache, a recurrent state) and run everything else over all rows at once."""

    def __init__(self, caches: list[KVCache], sizes: list[int]):
        self.caches, self.sizes = caches, sizes

    def split(self, t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return list(t.split(self.sizes, dim=dim))


class TreeRows:
    """A cache seen by a tree's verification pass (Transformer.forward_tree): its S rows are written at [length,
    length + S), a chain (the pending token and the drafts after it) first, then leaves, each a sibling of a chain
    row: depths[r] is row r's distance from the pending token. The chain's rows attend as a chain pass's do; a leaf's
    row at depth d attends to the positions before length + d and to itself, which attention reads contiguously: its
    keys and values are put in the slot of the chain row at its depth for its own row's attention, then put back.
    `commit` keeps one path: the chain up to a depth, or a leaf after the chain rows before it."""

    def __init__(self, cache: KVCache, depths: list[int], chain_rows: int):
        self.cache, self.depths, self.chain_rows = cache, depths, chain_rows
        self.leaves: dict[int, list] = {}  # leaf row -> per recurrent layer (module, layer, its inputs), for commit

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def hidden(self):
        return self.cache.hidden

    @property
    def feature_layers(self) -> dict:
        return self.cache.feature_layers

    def store_hidden(self, rows: torch.Tensor) -> None:
        self.cache.store_hidden(rows)

    def store_feature(self, layer: int, rows: torch.Tensor) -> None:
        self.cache.store_feature(layer, rows)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.write(layer, k, v)

    def read(self, layer: int, new: int):
        return self.cache.read(layer, new)

    def attend(self, attention, q, k, v, layer: int) -> torch.Tensor:
        """The rows' attention (B, H, S, D) for one layer (attention: the layer's Attention module)."""
        c, C, S = self.cache, self.chain_rows, q.shape[2]
        start = c.length
        if k is not None:
            c.write(layer, k, v)  # every row's, at [start, start + S)
        source = attention.source
        # the chain's rows: a chain pass's attention over the positions up to each (k None: read, not written)
        parts = [attention._attention(q[:, :, :C], None, None, _Prefix(c, start), source, None, C, None)]
        keys, values = c.k[source], c.v[source]
        for r in range(C, S):
            d = self.depths[r]
            slot, own = start + d, start + r
            kept = keys[:, :, slot].clone(), values[:, :, slot].clone()
            keys[:, :, slot], values[:, :, slot] = keys[:, :, own], values[:, :, own]
            try:
                parts.append(attention._attention(q[:, :, r:r + 1], None, None, _Prefix(c, slot), source, None, 1,
                                                  None))
            finally:
                keys[:, :, slot], values[:, :, slot] = kept
        return torch.cat(parts, dim=2)

    def mix(self, layer_module, mixed, b, a, layer: int) -> torch.Tensor:
        """A recurrent (linear-attention) layer's rows (B, Hv, S, Dv): the chain's through the layer's state, as a
        chain pass runs them (the state after each kept); each leaf's one step from the state after its parent
        (kept since the chain ran), computed on a scratch copy that leaves the layer's state as the chain left it.
        The leaf's inputs are kept: commit replays its step where the leaf is kept."""
        c, C = self.cache, self.chain_rows
        state, start = c.states[layer], c.length
        parts = [layer_module._mix(mixed[:, :C], b[:, :C], a[:, :C], state, start, None)]
        for r in range(C, mixed.shape[1]):
            d = self.depths[r]
            conv, index = state.saved[start + d]
            rows = (mixed[:, r:r + 1], b[:, r:r + 1], a[:, r:r + 1])
            parts.append(layer_module._mix(*rows, _Scratch(conv, state.slots[index]), start + d, None))
            self.leaves.setdefault(r, []).append((layer_module, layer, rows))
        return torch.cat(parts, dim=2)

    @staticmethod
    def commit(cache: KVCache, start: int, path: list[int]) -> None:
        """Keep the rows `path` (row indices of a tree pass that wrote from `start`: the pending token's row 0, then
        one row per depth) as positions start .. start + len(path) - 1: the chain's rows are in place; a leaf's keys
        and values (and kept hidden states) move to its depth's slot, and each recurrent layer takes the leaf's step
        from the state after its parent. cache.length becomes start + len(path)."""
        tree, cache.tree = cache.tree, None
        for depth, row in enumerate(path):
            if row == depth:
                continue
            src, dst = start + row, start + depth
            for t in cache.tensors():
                t[:, :, dst] = t[:, :, src]
            for kept in (cache.hidden, cache.features):
                if kept is not None:
                    kept[dst] = kept[src]
        leaf = path[-1] if path[-1] != len(path) - 1 else None
        if not cache.recurrent:
            cache.length = start + len(path)
            return
        if leaf is None:  # the chain's own states, kept after each of its rows
            cache.length = max(cache.length, start + len(path))
            cache.rollback(start + len(path))
            return
        cache.rollback(start + len(path) - 1)  # the state after the leaf's parent, then the leaf's step
        for module, layer, rows in tree.leaves[leaf]:
            module._mix(*rows, cache.states[layer], cache.length, None)
        cache.length = start + len(path)


class _Scratch:
    """A recurrent state's stand-in for one step that must not change it (a tree's leaf): it reads the given
    convolution inputs and matrix, writes the step's matrix into a tensor of its own, and keeps nothing."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor):
        self.conv, self.ssm, self.out = conv, ssm, torch.empty_like(ssm)

    def fresh(self) -> tuple[int, torch.Tensor]:
        return -1, self.out

    def save(self, position: int, conv: torch.Tensor, index: int) -> None:
        pass

    def trim(self, length: int) -> None:
        pass


class _Prefix:
    """A cache read as a pass of `new` rows at `at` reads it: the positions before at + new."""

    def __init__(self, cache: KVCache, at: int):
        self.cache, self.at = cache, at

    def read(self, layer: int, new: int):
        end = self.at + new
        return self.cache.k[layer][:, :, :end], self.cache.v[layer][:, :, :end]


class PositionedWrites:
    """A cache seen by one pass at given positions: writes go to those positions (index_copy_, no host
    value needed), reads give the first `span` positions, which the pass masks to each row's own."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int):
        self.cache, self.positions, self.span = cache, positions, span

    @property
    def hidden(self):
        return self.cache.hidden

    @property
    def feature_layers(self) -> dict[int, int]:
        return self.cache.feature_layers

    def store_hidden(self, rows: torch.Tensor) -> None:
        self.cache.hidden.index_copy_(0, self.positions, rows)

    def store_feature(self, layer: int, rows: torch.Tensor) -> None:
        c, dim = self.cache, rows.shape[-1]
        for j in c.feature_layers[layer]:
            c.features[:, j * dim:(j + 1) * dim].index_copy_(0, self.positions, rows)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        c = self.cache
        c.k[layer].index_copy_(2, self.positions, k)
        c.v[layer].index_copy_(2, self.positions, v)
        return c.k[layer][:, :, :self.span], c.v[layer][:, :, :self.span]

    def read(self, layer: int, new: int):
        c = self.cache
        return c.k[layer][:, :, :self.span], c.v[layer][:, :, :self.span]
