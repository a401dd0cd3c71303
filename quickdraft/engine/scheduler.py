"""What each step works on, decided in one place: which waiting request starts next, which prompts prefill in the rows
a pass has left and how many, and where a beginning another running sequence holds is copied instead of prefilled.

Admission is shortest expected prefill first, with ageing: a request's expected prefill (the tokens no kept slot holds,
at this machine's measured price of a prompt row) counts down by AGEING seconds for each second it has waited, so a
short request behind a queue of long prompts starts within seconds, and a long one waits behind shorter ones no longer
than about its own prefill. A prompt prefilled beside decoding sequences takes the rows that keep their step within
SLOWDOWN of a step without it at first, twice as many for each DOUBLING seconds it has waited for its first token: the
streams keep most of their speed through a short prompt's prefill, and a long prompt's first token is not held behind
them for tens of seconds.

The scheduler decides; the engine does. Its inputs are what a sequence is to it (a prompt, how much of it is in the
cache, how long it waited: `Prefilling`) and what passes cost (`prices.pass_seconds`), so a test can drive every
decision with plain objects and no model (tests/test_scheduler.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from quickdraft.runtime.slots import MIN_REUSE, common_prefix

STARVED = 4  # a prompt passed over this many steps in a row is prefilled before shorter ones
# A prompt prefilled beside decoding sequences takes at most the rows that keep their step within SLOWDOWN of a step
# without it (vLLM's chunked-prefill budget, llama.cpp's n_ubatch, chosen from measured pass costs), and at least
# PREFILL_MIN rows: the prompt goes on, the streams keep half their speed or more.
SLOWDOWN = 2.0
PREFILL_MIN = 4
# A prompt's share grows as it waits: the allowed slowdown doubles every DOUBLING seconds since it was started (on a
# 2-core AVX2 CPU a prompt row costs 0.43 of a one-row step, so beside three streams SLOWDOWN alone prefilled ~4 rows a
# step: a 400-token tool result took ~18 s to its first token; see docs/performance.md).
DOUBLING = 2.0
# Admission: each second a request waits takes AGEING seconds off its expected prefill (shortest first, without
# starving the long ones).
AGEING = 1.0


class Prefilling(Protocol):
    """A sequence as the scheduler sees it."""
    prompt: list[int]
    prefilled: int  # of the prompt, the tokens its cache holds
    waited: int  # steps in a row its prefill got no rows
    started: float  # when it was started (perf_counter)
    ended: bool
    copyable: bool  # a beginning of its prompt may be copied into its cache from another's (share)

    @property
    def prefilling(self) -> bool: ...


class Prices(Protocol):
    """What passes cost here (speculative/policy.AdaptivePolicy answers)."""
    t_plain: float | None
    t_pass: dict

    def pass_seconds(self, rows: int) -> float | None: ...


@dataclass
class Prefills:
    """A step's prompt rows: per prefilling sequence how many of its prompt's next tokens the pass takes (in the order
    they were chosen), and those that wait a step for a beginning another sequence prefills now."""
    rows: dict = field(default_factory=dict)
    sharing: set = field(default_factory=set)


class Waiting(Protocol):
    """A request waiting to start, as the scheduler sees it."""
    prompt: list[int]
    submitted: float  # when it arrived (perf_counter)


class Scheduler:
    def __init__(self, max_rows: int, prices: Prices):
        """max_rows: the most rows a pass takes (a prefill chunk's); prices: what passes cost (the policy's)."""
        self.max_rows, self.prices = max_rows, prices

    # ---- admission ----------------------------------------------------------------------------------

    def next_admitted(self, waiting: list, held: Callable[[list[int]], int] = lambda prompt: 0,
                      now: float | None = None) -> int:
        """The index in `waiting` of the request to start next: the least expected prefill (its prompt's tokens less
        those a kept slot holds: held(prompt)) less AGEING seconds for each second it has waited; first come first
        served before any pass was priced."""
        per_row = self.row_seconds()
        if per_row is None or len(waiting) < 2:
            return 0
        now = time.perf_counter() if now is None else now

        def score(i: int) -> float:
            w = waiting[i]
            return (len(w.prompt) - held(w.prompt)) * per_row - AGEING * (now - w.submitted)
        return min(range(len(waiting)), key=lambda i: (score(i), i))

    def row_seconds(self) -> float | None:
        """Seconds a prompt row costs in a prefill chunk (None before the policy can price a pass)."""
        chunk = self.prices.pass_seconds(self.max_rows)
        return chunk / self.max_rows if chunk else None

    # ---- prefill ------------------------------------------------------------------------------------

    def prefills(self, prefilling: list, running: list, taken: int,
                 copy: Callable[[object, object, int], bool] = lambda s, other, n: False) -> Prefills:
        """The prompt rows of a pass whose decoding sequences took `taken` rows: the shortest prompt first (a short
        request behind a long one gets its first token after a step or two), but one passed over STARVED steps in a
        row before any (short prompts arriving every step would hold a long one back for ever); beside decoding
        sequences only the budget's rows (`budget`). Before a sequence takes rows, a beginning of its prompt that a
        running sequence holds is copied from there (`copy(s, other, n)` does it and says whether it could: see
        `share`). running: every sequence of the step (the prefilling ones included)."""
        room = self.max_rows - taken
        if taken and prefilling:
            waited = time.perf_counter() - min(s.started for s in prefilling)
            room = min(room, self.budget(taken, waited))
        out = Prefills()
        for s in sorted(prefilling, key=lambda s: (s.waited < STARVED, len(s.prompt) - s.prefilled)):
            if self.share(s, running, out.rows, copy):
                out.sharing.add(s)
                continue
            n = min(room, len(s.prompt) - s.prefilled)
            if n <= 0:
                break
            out.rows[s] = n
            room -= n
        for s in prefilling:
            s.waited = 0 if s in out.rows or s in out.sharing else s.waited + 1
        return out

    def budget(self, taken: int, waited: float = 0.0) -> int:
        """The rows of prompt a pass beside `taken` decoding rows may take: the most whose pass is estimated within
        SLOWDOWN of one without them, doubled for each DOUBLING seconds the oldest prompt prefilling has `waited`, at
        least PREFILL_MIN; all that is left before any pass was timed."""
        prices, room = self.prices, self.max_rows - taken
        now = prices.pass_seconds(taken) if taken > 1 or taken in prices.t_pass else prices.t_plain
        if now is None or not prices.t_pass:
            return room
        limit = SLOWDOWN * 2 ** min(waited / DOUBLING, 16.0) * now
        fits = [r for r in range(1, room + 1) if (prices.pass_seconds(taken + r) or 0.0) <= limit]
        return max(min(PREFILL_MIN, room), max(fits, default=0))

    @staticmethod
    def share(s, running: list, prefilled_now: dict, copy: Callable[[object, object, int], bool]) -> bool:
        """Before a prefilling sequence takes rows: a beginning of its prompt that another running sequence has in its
        cache already (agents or chats under one system prompt arriving together: none had it in a kept slot when
        they were started) is copied from there (copy: bit for bit what its own prefill would write) rather than
        computed again. True where it should wait a step instead: a sequence ahead of it in this pass
        (prefilled_now) is prefilling that beginning now."""
        if not s.copyable:
            return False
        shared = [(o, c) for o in running if o is not s and not o.ended
                  for c in [min(common_prefix(s.prompt, o.prompt), len(s.prompt) - 1)] if c >= s.prefilled + MIN_REUSE]
        best, have = None, s.prefilled
        for o, common in shared:
            if min(o.prefilled, common) > have:
                best, have = o, min(o.prefilled, common)
        if best is not None and have >= s.prefilled + MIN_REUSE:
            copy(s, best, have)
        return any(o in prefilled_now and o.prefilled < common and common >= s.prefilled + MIN_REUSE
                   for o, common in shared)
