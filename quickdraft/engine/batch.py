"""Sequences stepped together (continuous batching): admission, and Engine.step over every active sequence."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.constraint import Constraint
from quickdraft.engine.engine import Engine, Item
from quickdraft.engine.reports import Event
from quickdraft.engine.sequence import Halt, Sequence


class Batch:
    """Sequences stepped together. A step is one target pass over the rows of every active sequence: a plain step's
    one row, a round's last token and drafts, a newcomer's next chunk of prompt (so the streams already running go on
    while it prefills). Decoding one token reads every weight; a pass of several sequences' rows reads them once, so
    on these kernels a few sequences cost little more than one. Each sequence is accepted and rolled back on its own,
    and its rows are computed as its own pass computes them (Transformer.forward_segments): its output is the one it
    gets alone, token for token.

    How much each sequence drafts is chosen for the step as a whole (speculative/policy.BatchPlan): drafts are rows
    of the same pass, and spare compute goes where it earns most tokens per second. With one sequence active a step
    is that sequence's own step, exactly as Engine.generate runs it (both are Engine.step)."""

    def __init__(self, engine: Engine, parallel: int | None = None):
        self.engine = engine
        # every decoding sequence has a row in each pass, and a newcomer's prefill one at least
        self.parallel = min(parallel or engine.slots.count, engine.max_rows - 1)
        self.active: list[Sequence] = []
        self.last_rows = 0  # rows of the latest pass (0: the step ran none)

    def room(self) -> int:
        """How many more sequences may start now."""
        return max(0, min(self.parallel - len(self.active), self.engine.slots.free()))

    def add(self, prompt: list[int], params: SamplingParams, speculation: SpeculationConfig | None = None,
            halt: Halt | None = None, constraint: Constraint | None = None, reuse: bool = True,
            wanted: Iterable[list[int]] = (), scope=None) -> Sequence:
        """Start a sequence (Engine.start's arguments): its prefill runs in the next steps. QuickdraftError if it
        does not fit the context; RuntimeError without room."""
        if self.room() == 0:
            raise RuntimeError(f"the batch runs {len(self.active)} sequences, its most")
        s = self.engine.start(prompt, params, speculation, halt, constraint, reuse, wanted, scope)
        self.active.append(s)
        return s

    @torch.inference_mode()
    def step(self, deliver: Callable[[Sequence, Item], None]) -> None:
        """One step of every active sequence: deliver(s, item) for each of its events in order (a halt set by
        deliver ends the sequence at that token), the last one it gets being its final Event, or the exception it
        failed with. Ended sequences leave the batch, their slots kept for reuse. A sequence whose item deliver
        cannot take fails alone (deliver gets that exception)."""
        for s, item in self.engine.step(self.active):
            try:
                deliver(s, item)
            except Exception as e:  # noqa: BLE001 -- handing it over failed: that sequence fails alone
                if isinstance(item, Exception):
                    raise
                if not s.ended:
                    self.engine.fail(s, e)
                deliver(s, e)
        self.last_rows = self.engine.last_rows
        self.active = [s for s in self.active if not s.ended]

    def fail(self, error: Exception, deliver: Callable[[Sequence, Item], None]) -> None:
        """Fail every active sequence with error (a step that failed outside any one sequence)."""
        for s in list(self.active):
            if not s.ended:
                deliver(s, self.engine.fail(s, error))
        self.active.clear()

    def run(self, requests: list[dict]) -> list[list[Event]]:
        """Generate every request (a dict of add's arguments), each starting as soon as there is room (first come,
        first served): the events of each, in order. What a request fails with is raised."""
        out: list[list[Event]] = [[] for _ in requests]
        index: dict[int, int] = {}
        waiting = list(range(len(requests)))

        def deliver(s: Sequence, event) -> None:
            if isinstance(event, Exception):
                raise event
            out[index[id(s)]].append(event)

        try:
            while waiting or self.active:
                while waiting and self.room():
                    i = waiting.pop(0)
                    index[id(self.add(**requests[i]))] = i
                self.step(deliver)
        finally:  # a request failed: the others end here, their slots free
            for s in list(self.active):
                self.engine.fail(s, RuntimeError("another request of the batch failed"))
            self.active.clear()
        return out
