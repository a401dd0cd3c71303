"""The scheduler's decisions, driven with plain objects and made-up prices: no model (engine/scheduler.py)."""

from dataclasses import dataclass, field

from quickdraft.engine.scheduler import PREFILL_MIN, SLOWDOWN, STARVED, Scheduler


@dataclass(eq=False)
class Seq:
    prompt: list[int]
    prefilled: int = 0
    waited: int = 0
    ended: bool = False
    copyable: bool = True
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
