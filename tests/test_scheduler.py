"""The scheduler's decisions, driven with plain objects and made-up prices: no model (engine/scheduler.py)."""

import time
from dataclasses import dataclass, field

from quickdraft.engine.scheduler import AGEING, DOUBLING, PREFILL_MIN, SLOWDOWN, STARVED, Scheduler


@dataclass(eq=False)
class Seq:
    prompt: list[int]
    prefilled: int = 0
    waited: int = 0
    ended: bool = False
    copyable: bool = True
    started: float = field(default_factory=time.perf_counter)
    copied: list = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)


@dataclass
class Prices:
    """A pass of r rows costs plain + per_row * (r - 1), once any pass was timed."""
    plain: float = 1.0
    per_row: float = 0.1
    timed: bool = True

    @property
    def t_plain(self):
        return self.plain

    @property
    def t_pass(self):
        return {2: self.pass_seconds(2)} if self.timed else {}

    def pass_seconds(self, rows):
        return self.plain + self.per_row * (rows - 1) if self.timed else None


def copy(s, other, n):
    s.copied.append((other, n))
    s.prefilled = n
    return True


def test_the_shortest_prompt_goes_first_and_fills_what_is_left():
    long, short = Seq(list(range(300))), Seq(list(range(1000, 1030)))
    out = Scheduler(64, Prices()).prefills([long, short], [long, short], 0)
    assert list(out.rows) == [short, long] and out.rows == {short: 30, long: 34}
    assert long.waited == short.waited == 0


def test_a_prompt_passed_over_starved_steps_goes_first():
    sched = Scheduler(64, Prices())
    long = Seq(list(range(300)))
    for step in range(STARVED + 1):
        short = Seq(list(range(1000, 1064)))  # a newcomer every step that fills the pass alone
        out = sched.prefills([long, short], [long, short], 0)
        assert list(out.rows)[0] is (long if step == STARVED else short), step
    assert long.waited == 0


def test_beside_decoding_rows_a_prefill_takes_the_budget_and_all_before_any_timing():
    prices = Prices(plain=1.0, per_row=1 / 16)  # a row costs 1/16 of a step: 16 more rows double it
    sched = Scheduler(64, prices)
    assert sched.budget(1) == 16 and prices.pass_seconds(1 + 16) <= SLOWDOWN * prices.t_plain
    long = Seq(list(range(300)))
    assert sched.prefills([long], [long], 1).rows == {long: 16}
    assert Scheduler(64, Prices(per_row=5.0)).budget(1) == PREFILL_MIN  # rows dear: the prompt still goes on
    assert Scheduler(64, Prices(timed=False)).budget(3) == 61  # nothing timed yet: the rows left


def test_a_shared_beginning_is_copied_from_a_running_sequence_or_waited_for():
    system = list(range(200))
    first, second = Seq(system + [7, 8]), Seq(system + [5, 6, 4])  # (the shorter goes first)
    sched = Scheduler(64, Prices())
    out = sched.prefills([first, second], [first, second], 0, copy)  # both new: the first prefills, the second waits
    assert out.rows == {first: 64} and out.sharing == {second} and second.waited == 0 and not second.copied
    first.prefilled = 150
    out = sched.prefills([first, second], [first, second], 0, copy)
    assert second.copied == [(first, 150)] and second.prefilled == 150  # what the first holds so far, copied
    assert second in out.sharing  # and the rest of the beginning follows from its next chunk
    recurrent = Seq(system + [1], copyable=False)
    out = sched.prefills([recurrent], [first, recurrent], 0, copy)
    assert out.rows == {recurrent: 64} and not recurrent.copied  # a recurrent state prefills its own


def test_a_prompt_that_waits_takes_more_of_each_step():
    """The allowed slowdown doubles every DOUBLING seconds the oldest prompt has waited for its first token: the
    streams keep their speed through a short prefill, and a long prompt is not held behind them."""
    prices = Prices(plain=1.0, per_row=1 / 16)
    sched = Scheduler(64, prices)
    assert sched.budget(1, 0.0) == 16 and sched.budget(1, DOUBLING) == 48 and sched.budget(1, 3 * DOUBLING) == 63
    old = Seq(list(range(300)), started=time.perf_counter() - DOUBLING)
    assert sched.prefills([old], [old], 1).rows[old] >= 47


@dataclass
class Request:
    prompt: list[int]
    submitted: float


def test_admission_is_shortest_expected_prefill_first_with_ageing():
    """A 4-token request behind long prompts starts first; a long one that has waited its prefill's time goes before a
    newer short one; what a kept slot holds does not count; first come first served before anything is priced."""
    prices = Prices(plain=1.0, per_row=1 / 16)  # a 64-row chunk: 4.9 s, 0.077 s a row
    sched = Scheduler(64, prices)
    now = 100.0
    queue = [Request(list(range(1000)), now - 1), Request(list(range(900)), now - 0.5), Request([1, 2, 3, 4], now)]
    assert sched.next_admitted(queue, now=now) == 2
    per_row = sched.row_seconds()
    patient = Request(list(range(1000)), now - 1000 * per_row / AGEING - 1)  # waited longer than its prefill takes
    assert sched.next_admitted([Request([1, 2, 3, 4], now), patient], now=now) == 1
    held = lambda prompt: len(prompt) - 1 if len(prompt) == 1000 else 0  # noqa: E731 (a kept slot holds the 1000)
    assert sched.next_admitted(queue, held, now=now) == 0
    assert Scheduler(64, Prices(timed=False)).next_admitted(queue, now=now) == 0
