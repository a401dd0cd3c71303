"""Kept sequences (prefix reuse). A slot holds one sequence's target cache, the drafter that speaks for it (a draft
model's own cache) and the tokens the cache holds; a request whose prompt begins with tokens a slot holds prefills
only the rest. A chat or an agent resends its whole history every turn, so each turn after the first prefills only
what is new.

Reuse is exact where the kernels give a row the same bits whatever rows and threads share its pass
(runtime/plan.cpu_path names those paths: bf16 on a CPU with AVX-512 VNNI, float32 from float weights on one with
AVX2 and FMA, CUDA): there every pass the engine runs computes each row the way a one-token step computes it
(prefill in row-wise chunks: engine/engine.py), so a position's keys and values are the same bits whether a
prefill, a decoding step or a verification wrote them, in this request or in an earlier one.

A hybrid model's recurrent state cannot roll back further than the positions it keeps (runtime/kv_cache.HISTORY):
a slot also keeps snapshots of it (checkpoints) where turns end, at the end of each prefill and of each
generation, and a prompt that leaves a slot between them restarts from the last checkpoint before it.

Slots are made when first needed, up to `count`; one whose conversation ends is reused for the next (least recently
used first). With a memory budget (--cache-ram), what bounds them is the memory their positions take (on the CPU a
cache takes memory as it fills: KVCache.used_bytes): a new prompt that would take the slots past it drops the least
recently used conversations other than the one it continues, their memory given back. Taking a slot for a prompt
that shares only its beginning (an agent's sub-agent, a second conversation under the same system prompt) would cut the
slot's own conversation: while another slot is free or older, the common prefix is copied there instead (a copy of keys
and values, far cheaper than prefilling them).

On a GPU a slot is a whole cache in the card's memory, so few are kept; a conversation its slot gives up for another
is copied to host memory (HostCopies, within --cache-ram, as llama-server's prompt cache keeps its prompts) and copied
back into a slot when it returns, rather than prefilled again. Both copies, and the checksums, run on the engine's
thread between steps (a pause of the running requests: the copy's bytes over the link, and CRC-32 at a few GB/s).
Each copy carries a checksum of its bytes: a copy that no longer matches it (memory gone bad, a bug) is dropped and
the prompt prefilled, never read into a cache.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from quickdraft.runtime.kv_cache import KVCache

MIN_REUSE = 16  # a shorter common prefix is prefilled again rather than taken from another conversation's slot
CHECKPOINTS = 4  # recurrent-state snapshots kept per slot (the most recent positions)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share: by halving, each comparison of slices in C (a prompt is compared with
    every kept slot, and with the prompts waiting their turn: thousands of tokens each)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False)  # a slot is itself: compared and kept in sets by identity
class Slot:
    cache: KVCache
    drafter: object | None  # the slot's own drafter (speculative/base.Drafter), None without speculation
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys and values the cache holds, in order
    checkpoints: dict[int, list] = field(default_factory=dict)  # position -> recurrent states there (hybrids)
    used: int = 0  # when it was last taken (a counter)
    prompt_n: int = 0  # the length of the prompt it was last taken for
    busy: bool = False  # a sequence runs in it (taken, not yet released: engine.Engine.release)
    # how its conversation's drafts have been accepted (speculative/policy.Acceptance): the next turn that continues
    # it starts from that, not from what other conversations' texts taught the policy
    acceptance: object | None = None

    def reusable(self, prompt: list[int]) -> int:
        """How many leading tokens of prompt this slot can keep: the common prefix, less one (a prefill passes at
        least the prompt's last token, whose logits give the first new token), and for a recurrent state the last
        position it can return to within that."""
        n = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        if not self.cache.recurrent or n == 0:
            return max(n, 0)
        return max(p for p in self.restorable() if p <= n)

    def restorable(self) -> set[int]:
        """Positions a recurrent state can return to: those it keeps, the checkpoints, and the start."""
        return set(self.cache.recurrent[0].saved) | set(self.checkpoints) | {0}

    def keep(self, n: int) -> None:
        """Forget everything after the first n tokens (n from reusable)."""
        if self.cache.recurrent and n not in self.cache.recurrent[0].saved:
            if n in self.checkpoints:
                self.cache.restore_snapshot(n, self.checkpoints[n])
            else:
                self.cache.reset()
        else:
            self.cache.rollback(n)
        del self.tokens[n:]
        for p in [p for p in self.checkpoints if p > n]:
            del self.checkpoints[p]

    def checkpoint(self) -> None:
        """Keep the recurrent states where the cache now ends (a turn boundary); nothing without them."""
        if not self.cache.recurrent or self.cache.length in self.checkpoints or self.cache.length == 0:
            return
        self.checkpoints[self.cache.length] = self.cache.snapshot(self.cache.length)
        while len(self.checkpoints) > CHECKPOINTS:
            del self.checkpoints[min(self.checkpoints)]

    def forget(self) -> None:
        self.cache.reset()
        self.tokens.clear()
        self.checkpoints.clear()
        if self.drafter is not None:
            self.drafter.forget()

    def copy_prefix(self, other: "Slot", n: int) -> bool:
        """Take other's first n tokens (keys and values copied; a recurrent state only where other can give it at
        n without a pass: a position it keeps, or a checkpoint). False where it cannot."""
        state = None
        if other.cache.recurrent:
            if n in other.cache.recurrent[0].saved:
                state = other.cache.snapshot(n)
            elif n in other.checkpoints:
                state = other.checkpoints[n]
            else:
                return False
        self.forget()
        self.cache.copy_prefix(other.cache, n)
        if state is not None:
            self.cache.restore_snapshot(n, state)
            self.checkpoints[n] = state
        self.tokens[:] = other.tokens[:n]
        if self.drafter is not None and other.drafter is not None:  # the draft's share of the prefix too
            self.drafter.adopt(other.drafter, n)
        return True

    def nbytes(self) -> int:
        """Its memory if every position of its context were taken."""
        return self.cache.nbytes() + self._besides()

    def used_bytes(self) -> int:
        """The memory it takes now (KVCache.used_bytes; a draft's cache is its window's, or counted whole)."""
        return self.cache.used_bytes() + self._besides()

    def _besides(self) -> int:
        """Its checkpoints' and its drafter's memory."""
        kept = sum(t.numel() * t.element_size() for states in self.checkpoints.values() for s in states for t in s)
        return kept + (self.drafter.cache_bytes() if self.drafter is not None else 0)

    def drop(self) -> None:
        """Forget its conversation and give its memory back (a budget's least recently used)."""
        self.forget()
        self.cache.release()


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a host tensor's bytes."""
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy())


@dataclass(eq=False)
class HostCopy:
    """A conversation a slot gave up, in host memory: its tokens and the cache's positions at them
    (KVCache.export_prefix), each with its checksum."""
    tokens: list[int]
    tensors: list[torch.Tensor]
    sums: list[int]
    used: int  # its slot's last use (a Slots clock tick)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def intact(self) -> bool:
        return [checksum(t) for t in self.tensors] == self.sums


class HostCopies:
    """Conversations given up by slots whose caches are not in host memory (a GPU's), kept in host memory within
    `budget` bytes, the least recently used dropped first. Not for recurrent states (a hybrid's slot keeps
    checkpoints of its own)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.copies: list[HostCopy] = []
        self.stored = 0  # conversations copied out
        self.restored = 0  # copied back into a slot
        self.damaged = 0  # found not to match their checksum, dropped: the prompt was prefilled
        self.dropped = 0  # dropped to stay within the budget

    def put(self, slot: Slot) -> None:
        """Copy out what the slot holds before it is forgotten (nothing shorter than MIN_REUSE, nor a recurrent
        state). A copy whose tokens begin what the slot holds is superseded by it."""
        n = len(slot.tokens)
        if n < MIN_REUSE or slot.cache.recurrent or n > slot.cache.length:
            return
        if n * slot.cache.position_bytes() > self.budget:  # (it alone would not fit)
            self.dropped += 1
            return
        tokens = list(slot.tokens)
        longer = next((c for c in self.copies if common_prefix(c.tokens, tokens) == n), None)
        if longer is not None:  # a copy holds all of it already (and more)
            longer.used = max(longer.used, slot.used)
            return
        self.copies = [c for c in self.copies if common_prefix(c.tokens, tokens) < len(c.tokens)]
        tensors = slot.cache.export_prefix(n)
        self.copies.append(HostCopy(tokens, tensors, [checksum(t) for t in tensors], slot.used))
        self.stored += 1
        while self.copies and self.nbytes() > self.budget:
            self.copies.remove(min(self.copies, key=lambda c: c.used))
            self.dropped += 1

    def best(self, prompt: list[int]) -> tuple[HostCopy | None, int]:
        """The copy holding the longest beginning of prompt, and how many of its tokens a slot may take (less one:
        a prefill passes at least the prompt's last token)."""
        best, n = None, 0
        for c in self.copies:
            m = min(common_prefix(c.tokens, prompt), len(prompt) - 1)
            if m > n:
                best, n = c, m
        return best, n

    def claim(self, copy: HostCopy) -> None:
        """Take a copy out before its slot is chosen (giving that slot's own conversation up may drop the oldest
        copies to fit: never this one). In a slot it is copied out again when that slot gives it up."""
        self.copies.remove(copy)

    def restore(self, copy: HostCopy, slot: Slot, n: int) -> bool:
        """Copy a claimed copy's first n positions back into slot (forgotten first; its drafter catches up as a new
        sequence's does). False where the copy is damaged: the slot left empty, the copy gone."""
        slot.forget()
        if not copy.intact():
            self.damaged += 1
            return False
        slot.cache.import_prefix(copy.tensors, n)
        slot.tokens[:] = copy.tokens[:n]
        self.restored += 1
        return True

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.copies)


KEPT_MAX = 64  # the most sequences kept where the memory they take is what bounds them (--cache-ram on the CPU)


class Slots:
    """Up to `count` slots, each made by `make` when first needed."""

    def __init__(self, make: Callable[[], Slot], count: int = 1, budget: int | None = None,
                 host: HostCopies | None = None):
        """budget: bytes the slots' memory may take (Slot.used_bytes), else no bound but `count`. host: where the
        conversations slots give up are copied to (a GPU's slots), else they are forgotten."""
        if count < 1:
            raise ValueError("at least one slot")
        self.make, self.count, self.budget, self.host = make, count, budget, host
        self.dropped = 0  # conversations dropped to keep within the budget
        self.evicted = 0  # conversations forgotten, or overwritten by a copied beginning, for another conversation
        self.slots: list[Slot] = []
        self.clock = itertools.count(1)

    def take(self, prompt: list[int], reuse: bool = True, wanted: Iterable[list[int]] = ()) -> tuple[Slot, int]:
        """A slot for prompt and how many of its leading tokens the slot already holds (0 without reuse). wanted: the
        prompts of requests waiting their turn; a slot one of them would reuse is not given to another conversation
        (copied into, or forgotten) while any other slot can be."""
        idle = [s for s in self.slots if not s.busy]
        best = self._best(prompt, idle) if reuse else None
        n = best.reusable(prompt) if best is not None else 0
        copy, m = self.host.best(prompt) if reuse and self.host is not None else (None, 0)
        if copy is not None and m >= n + MIN_REUSE:  # it returns: into a slot, rather than prefilled
            self.host.claim(copy)
            slot = self._free(set(), self._kept_for(wanted, idle))
            self.evicted += self._give_up(slot)
            if self.host.restore(copy, slot, m):
                return self._taken(slot, m, prompt)
            return self.take(prompt, reuse, wanted)  # damaged, and dropped: the best of what is left
        if best is not None and n >= MIN_REUSE:
            # a prompt that leaves best's last prompt (not merely its answer, which a client may send back tokenized
            # otherwise; nor a prompt sent again whole) is another conversation sharing a beginning: keep best's, and
            # copy the beginning
            if (common_prefix(best.tokens, prompt) < best.prompt_n
                    and len(idle) + (len(self.slots) < self.count) > 1):
                kept = self._kept_for(wanted, idle)
                other = self._free({best}, kept)
                # best is cut rather than a slot a waiting request would reuse overwritten
                if other not in kept or best in kept:
                    held = self._give_up(other, forget=False)
                    if other.copy_prefix(best, n):
                        self.evicted += held
                        return self._taken(other, n, prompt)
            if self.host is not None and common_prefix(best.tokens, prompt) < best.prompt_n:
                self.host.put(best)  # another conversation cuts it: its own may return
            best.keep(n)
            return self._taken(best, n, prompt)
        slot = self._free(set(), self._kept_for(wanted, idle))
        self.evicted += self._give_up(slot)
        return self._taken(slot, 0, prompt)

    def _give_up(self, slot: Slot, forget: bool = True) -> bool:
        """Before a slot takes another conversation: its own copied to host memory where there is one, then
        forgotten. True where it held one."""
        held = bool(slot.tokens)
        if held and self.host is not None:
            self.host.put(slot)
        if forget:
            slot.forget()
        return held

    @staticmethod
    def _best(prompt: list[int], idle: list[Slot]) -> Slot | None:
        """The idle slot holding the longest reusable beginning of prompt (the most recently used of equals)."""
        return max(idle, key=lambda s: (s.reusable(prompt), s.used), default=None)

    def _kept_for(self, wanted: Iterable[list[int]], idle: list[Slot]) -> set[Slot]:
        """The idle slots the waiting prompts would reuse."""
        kept = set()
        for prompt in wanted:
            best = self._best(prompt, idle)
            if best is not None and best.reusable(prompt) >= MIN_REUSE:
                kept.add(best)
        return kept

    def _free(self, avoid: set[Slot] = frozenset(), kept: set[Slot] = frozenset()) -> Slot:
        """An empty slot, else a new one while fewer than count exist, else the least recently used idle one (never
        one in `avoid`; one in `kept` only where every other is)."""
        idle = [s for s in self.slots if not s.busy and s not in avoid]
        empty = next((s for s in idle if not s.tokens), None)
        if empty is not None:
            return empty
        if len(self.slots) < self.count:
            self.slots.append(self.make())
            return self.slots[-1]
        if not idle:
            raise RuntimeError(f"all {self.count} slots are running sequences")
        return min(idle, key=lambda s: (s in kept, s.used))

    def held(self, prompt: list[int]) -> int:
        """The most leading tokens of prompt a slot holds (running or kept; a running one's can be copied), or a
        host copy: what its prefill would not compute (the scheduler's estimate of a waiting request's cost)."""
        kept = max((s.reusable(prompt) for s in self.slots), default=0)
        copy = self.host.best(prompt)[1] if self.host is not None else 0
        return max(kept, copy)

    def free(self) -> int:
        """How many more sequences can run now (slots not running one, made or still to be made)."""
        return self.count - sum(s.busy for s in self.slots)

    def _taken(self, slot: Slot, n: int, prompt: list[int]) -> tuple[Slot, int]:
        slot.used, slot.prompt_n, slot.busy = next(self.clock), len(prompt), True
        self._fit(slot, max(0, len(prompt) - slot.cache.held))
        return slot, n

    def fit(self) -> None:
        """Within the budget as running sequences' caches grow (a step's new positions): the least recently used idle
        slots dropped, as when a slot is taken."""
        self._fit(None, 0)

    def _fit(self, taken: Slot | None, new: int) -> None:
        """Within the budget once the taken slot holds `new` positions beyond what it held before: drop the least
        recently used idle slots holding memory until it is (what running ones hold is theirs)."""
        if self.budget is None:
            return
        need = self.used_bytes() + (new * taken.cache.position_bytes() if taken is not None else 0)
        if need <= self.budget:
            return
        holding = (s for s in self.slots if not s.busy and (s.tokens or s.cache.held))
        for victim in sorted(holding, key=lambda s: s.used):
            if need <= self.budget:
                break
            before = victim.used_bytes()
            if self.host is not None:
                self.host.put(victim)
            victim.drop()
            need -= before - victim.used_bytes()
            self.dropped += 1

    def used_bytes(self) -> int:
        return sum(s.used_bytes() for s in self.slots)

    def view(self) -> list[dict]:
        """Each slot as llama-server's GET /slots shows it (counts, never the tokens)."""
        return [{"id": i, "is_processing": s.busy, "n_ctx": s.cache.capacity, "n_tokens": len(s.tokens),
                 "n_prompt_last": s.prompt_n, "last_used": s.used, "bytes": s.used_bytes()}
                for i, s in enumerate(self.slots)]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.slots)
