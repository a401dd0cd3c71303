"""How many tokens to draft now: the k that maximises expected tokens per second, by measurement.

The policy measures what the speed model (speculative/speed.py) needs as the engine runs: a plain step, the
verification of k drafts, a drafted token's cost per source, a source's catch-up per round and the acceptance of
each draft position; it picks the best k, 0 (plain) included, probing now and then so that it can switch back.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from quickdraft.config import SpeculationConfig
from quickdraft.speculative import speed
from quickdraft.speculative.base import KFor

# A timing is the median of its last WINDOW samples (t_plain's: PLAIN_WINDOW). On a shared machine a step now and
# then takes two or three times as long (the process was preempted), and the machine's speed drifts by a quarter
# over minutes; an average lets one slow sample move the estimate, and a rarely timed one (t_plain while
# speculating) keeps it for hundreds of rounds. A median over a few recent samples drops the outlier and follows the
# drift. t_plain, timed once per REFRESH rounds while speculation wins, keeps fewer: its samples are far apart.
WINDOW = 5
PLAIN_WINDOW = 3
# A pass's seconds move with the machine's (a neighbour's load, its clock: a quarter over a few seconds here), and a
# choice compares a plain step timed at one moment with a verification, a drafted token or a catch-up timed at
# another: each of those (RELATIVE's kinds) is kept as a share of the plain step of its moment, and its seconds are
# that share of today's plain step. Timed apart, a verification taken in a fast spell against plain steps taken in a
# slow one looked free (v(1) of 1.0 where a paired timing gave 1.15-1.4 on an AVX2 build) and lost rounds looked won.
RELATIVE = ("verify", "tree", "draft", "feed")
CATCH_UP_EMA = 0.1  # weight of a new round in a source's mean catch-up seconds per round (about the last 10)
DECAY = 0.97  # per-round forgetting of acceptance counts (about the last 30 rounds matter)
CARRY = 0.2  # a new generation keeps this share of the acceptance counts: a prior, not its text's own
PROBE_K = 4  # the first round of a source not yet measured
# While plain decoding wins, a source is probed after probe_every plain steps, then after twice as many each time
# a probe loses (at most PROBE_MAX; each generation starts over), with at most PROBE_SHORT drafts: a probe costs a
# round that is expected to lose (a draft model's catch-up pass over the steps it missed, its drafts, a verification),
# and probing at a fixed interval made adaptive decoding 10-20% slower than plain where speculation does not pay.
# A probe that emits its tokens faster than plain steps would have (its drafting and verification; the catch-up is
# the switch's) keeps the wait at probe_every: speculation that was turned off by a noisy estimate where it pays
# (code-zh, int4 pair: 1.2x) came back only after several doubled waits.
PROBE_MAX = 256
PROBE_SHORT = 2
# A probe is expected to lose (where it is due, plain decoding is predicted to win): the steps between a source's probes
# are at least what its probe is expected to lose (its catch-up, drafts and verification against the plain steps its
# tokens would have taken) over PROBE_SHARE of a plain step, so that probing costs at most that share of the time, and
# at most PROBE_LIMIT steps, so that a source judged unprofitable is always tried again. (A draft model's probe on a
# 2-core AVX2 CPU, a 32-token window and two drafts, loses about 7 plain steps: one in 350 steps, where a probe every
# 16 to 256 steps cost 3-6% of plain decoding's speed there.)
PROBE_SHARE = float(os.environ.get("QUICKDRAFT_PROBE_SHARE", 0.02))  # (a test or measurement may probe more often)
PROBE_LIMIT = 1024
# While speculation wins, one plain step after this many rounds in a row times a plain step again: t_plain is
# measured only on plain steps, and a stale one (taken while the machine was slower, or before its caches were
# warm) can hold the policy speculating where plain decoding has become faster. One plain step in 64 rounds
# costs well under 1% where speculation wins by 1.2x or more. Where it wins by less than MARGIN, plain decoding is
# timed every REFRESH_NEAR rounds instead: there the choice depends on t_plain most and a plain step costs least.
REFRESH = 64
REFRESH_NEAR = 8
MARGIN = 1.15
# In a batched step (BatchPlan): a sequence's own acceptance of a source weighs against the policy's pooled estimate
# (n-gram lookup's acceptance varies most from one text to another) as if the pooled one were OWN_PRIOR rounds; and
# a drafter that must first take in tokens it missed pays a pass over them, each row of which costs about
# PREFILL_ROW of a one-token step (a 64-row pass took 12x a one-row one on this machine's kernels).
OWN_PRIOR = 2.0
PREFILL_ROW = 0.2
# A drafter that must first take in many tokens it has not seen (a draft model at a generation's start: the prompt, or
# its window; after a long run of plain steps) starts only where what it is expected to save over the tokens still to
# come pays for that catch-up, at its measured cost per token (t_feed, timed on catch-ups of FEED_MIN tokens or more).
# The tokens still to come: at most max_tokens, and HORIZON unless the answer is already longer (an answer's length
# so far is the best guess of what remains). Catch-ups of CATCH_UP_FREE tokens or fewer are a round's own cost.
# What it is expected to save is counted at 1 / START_MARGIN: the acceptance it is predicted with was measured on
# other text, and a catch-up spent on a text that drafts badly is lost whole.
HORIZON = 512
FEED_MIN = 16
CHUNK = 64  # the rows of a catch-up pass (a draft model takes in what it missed in passes of up to this many)
CATCH_UP_FREE = 2
START_MARGIN = 2.0
START = 64
# A probe (a few drafts while plain decoding wins, to measure acceptance again) is not taken where its drafter must
# first take in more than this many plain steps' worth of tokens (a draft model's window of a long prompt: seconds).
PROBE_CATCH_UP = 4.0
# Tree verification: the alternatives' kept share decays by this weight per tree round; while chains win, a tree is
# tried again after TREE_PROBE chain rounds.
TREE_EMA = 0.1
TREE_PROBE = 32
# A row's attention costs in proportion to the positions it reads: a timing taken at one length of the sequence is
# moved to another by rows x (the seconds a position adds to a row) x (the difference), that cost learned from plain
# steps taken SPREAD positions apart or more (PLACES of them kept). A verification of k + 1 rows timed on a short
# prompt would otherwise be taken for one on a 10,000-token prompt, where each of its rows reads 10,000 positions.
SPREAD = 2048
PLACES = 256
MOVED_MIN = 0.25
# The attention kernel reads each tile of keys and values once for all the rows of a pass: one row more adds
# ATTENTION_ROW of a row's reading of the positions, not a whole one (a verification's five rows over 12k positions
# took 4.74 ms against one row's 1.25 in one layer: 3.8x, docs/performance.md).
ATTENTION_ROW = 0.7
# Before a kind of pass is timed its price comes from this machine's calibration (Prior): its kernels' seconds per
# weight at one and five rows (weights/machine.py) times the model's weights, and what a step costs beyond its weights
# (attention, norms, rotary, the Python around the kernels) measured as the plain step less its weights. That other
# cost grows by OTHER_ROW of itself with each row of a pass (0.38-0.44 measured on a 2-core AMD Zen 3, AVX2, the int4
# default target at 100 positions) and is a model's per layer (the 0.5B draft's 24 layers took 12.8 ms of it, the 1.5B
# target's 28 14.5 ms: 0.53 and 0.52 ms a layer).
OTHER_ROW = 0.45


@dataclass(frozen=True)
class Prior:
    """What passes cost on this machine before any is timed: a cold process starts from the machine's own calibration
    instead of constants from elsewhere (api.prior builds it from weights/machine.py's figures)."""
    target: Callable[[int], float]  # seconds of the target's linear weights in a pass of r rows
    layers: int  # the target's decoder layers
    drafts: dict = field(default_factory=dict)  # source -> (its model's weight seconds by rows, its layers)
    free: frozenset = frozenset()  # sources whose drafting costs nothing (lookup)


class AdaptivePolicy:
    def __init__(self, cfg: SpeculationConfig, prior: Prior | None = None):
        self.cfg = cfg
        self.prior = prior  # the machine's calibrated prices, until the timings measured here replace them
        self.t_plain: float | None = None
        self.t_verify: dict[int, float] = {}  # k -> seconds to verify k drafts (k + 1 tokens)
        self.t_draft: dict[str, float] = {}  # source -> seconds per drafted token (per round: per_round)
        self.per_round: set[str] = set()  # sources whose round is one pass whatever its k (a DFlash block)
        # source -> mean seconds per round spent feeding the drafter what it missed while another source drafted
        # (a draft model after n-gram rounds: one pass over their tokens); paid once per round, whatever its k
        self.t_catch_up: dict[str, float] = {}
        self.t_feed: dict[str, float] = {}  # source -> seconds per token of a catch-up pass (a drafter taking in tokens)
        self.samples: dict = {}  # timing key -> its last (seconds, plain step then) (WINDOW; PLAIN_WINDOW for "plain")
        self.places: dict = {}  # timing key -> the sequence's length at each of those samples
        self.place: dict = {}  # timing key -> the mean of those lengths
        self.position = 0  # the length of the sequence the next choice and timings are for (the engine sets it)
        self.plain_at: deque = deque(maxlen=PLACES)  # (length, seconds) of plain steps, across generations
        self.t_position = 0.0  # seconds a position adds to a row (per_position), learned from plain_at
        self.resuming: set = set()  # sources that plain decoding was chosen over: their next round is a switch
        self.tried: dict[str, list[float]] = {}  # source -> decayed count of rounds reaching position i
        self.accepted: dict[str, list[float]] = {}
        self.since: dict[str, int] = {}  # source -> steps since its last round (its probes wait for a number of them)
        self.rounds_since_plain = 0
        self.probe_after: dict[str, int] = {}  # source -> plain steps before its next probe (backing off)
        self.warmed: set = set()  # timings seen once: the first of each kind pays one-off kernel setup
        self.t_pass: dict[int, float] = {}  # rows -> seconds of a batched pass over several sequences (Batch)
        # tree verification (--draft-tree): drafted rows -> seconds of a tree's pass; per source, the alternatives
        # kept per tree round (decayed), and the chain rounds since its last tree round
        self.t_tree: dict[int, float] = {}
        self.tree_gain: dict[str, float] = {}
        self.since_tree: dict[str, int] = {}
        self.since_chain: dict[str, int] = {}  # tree rounds since the source's last chain round
        # source -> its last measured choice between a tree and its chain: (candidates, k, tokens/s of each)
        self.tree_choice: dict[str, tuple[int, int, float, float]] = {}
        self.reasons: dict[str, dict[str, int]] = {}  # source -> why its rounds drafted (_why), counted
        self.last_reason: dict[str, str] = {}  # source -> why it was last given drafts (the engine reads it per round)

    def begin(self) -> None:
        """A new generation: its text may draft better or worse than the last one's, so probing starts over at
        probe_every, how often lookup leaves a draft model behind is its own, and the acceptance measured so far
        stays as a prior worth CARRY of its rounds (the new text's own rounds outweigh it after a few; the timings
        are kept whole: they describe the machine)."""
        self.probe_after.clear()
        self.t_catch_up.clear()
        for counts in (*self.tried.values(), *self.accepted.values()):
            counts[:] = [CARRY * c for c in counts]

    def _warm(self, key) -> bool:
        """False the first time `key` is timed (that sample is dropped), True after."""
        if key in self.warmed:
            return True
        self.warmed.add(key)
        return False

    # ---- measurements -----------------------------------------------------------------------

    def _timed(self, key, seconds: float) -> float | None:
        """key's timing with `seconds` its newest sample (_value); None while only its warm-up was seen."""
        if not self._warm(key):
            return None
        window = self.samples.setdefault(key, deque(maxlen=PLAIN_WINDOW if key == "plain" else WINDOW))
        relative = isinstance(key, tuple) and key[0] in RELATIVE
        window.append((seconds, self.plain_seconds() if relative else None))
        places = self.places.setdefault(key, deque(maxlen=window.maxlen))
        places.append(self.position)
        self.place[key] = statistics.fmean(places)
        return self._value(key)

    def _value(self, key) -> float:
        """The median of key's last few samples: of a RELATIVE kind, the median of their shares of the plain step of
        their moment, in seconds of a plain step now (at their mean place); else of their seconds (also while a sample
        was taken before any plain step)."""
        window = self.samples[key]
        if self.t_plain and all(ref for _, ref in window):
            share = statistics.median(t / ref for t, ref in window)
            return share * self._moved("plain", 1, self.t_plain, self.place[key])  # a plain step at their place
        return statistics.median(t for t, _ in window)

    def _rescale(self) -> None:
        """After a plain step moved t_plain: every RELATIVE timing, in seconds of a plain step now."""
        for kind in RELATIVE:
            table = getattr(self, f"t_{kind}")  # t_verify, t_tree, t_draft, t_feed
            for name in table:
                if (kind, name) in self.samples:  # (a value set from outside, as tests do, has none: kept)
                    table[name] = self._value((kind, name))

    def per_position(self) -> float:
        """Seconds a position of the sequence adds to a row's pass (its attention reading it): the slope between the
        plain steps taken at the shortest and the longest lengths seen, where they lie SPREAD apart; else 0."""
        return self.t_position

    def _slope(self) -> float:
        if len(self.plain_at) < 6:
            return 0.0
        seen = sorted(self.plain_at)
        third = len(seen) // 3
        low, high = seen[:third], seen[-third:]
        apart = statistics.fmean(n for n, _ in high) - statistics.fmean(n for n, _ in low)
        if apart < SPREAD:
            return 0.0
        return max(0.0, (statistics.median(t for _, t in high) - statistics.median(t for _, t in low)) / apart)

    def _moved(self, key, rows: int, seconds: float, position: float | None = None) -> float:
        """A timing of `rows` rows, taken at the lengths its samples were, moved to the sequence's length `position`
        (default: now)."""
        if key not in self.place or not self.t_position:
            return seconds
        position = self.position if position is None else position
        # at least MOVED_MIN of what was measured: moved far down, a slope learned from noisy steps could reach 0
        return max(seconds + attention_rows(rows) * self.t_position * (position - self.place[key]),
                   MOVED_MIN * seconds)

    def plain_seconds(self) -> float | None:
        """A plain step at the sequence's length now: t_plain, moved there."""
        return None if self.t_plain is None else self._moved("plain", 1, self.t_plain)

    def record_plain(self, seconds: float) -> None:
        t = self._timed("plain", seconds)
        if t is not None:
            self.t_plain = t
            self.plain_at.append((self.position, seconds))
            self.t_position = self._slope()
            self._rescale()
        self._tick()
        self.rounds_since_plain = 0

    def _tick(self, drafted: str | None = None) -> None:
        """A step went by: every source waits one more step, but the one that drafted in it."""
        for source in self.since:
            self.since[source] += 1
        if drafted is not None:
            self.since[drafted] = 0

    def record_pass(self, rows: int, seconds: float) -> None:
        """A batched pass (engine.Batch) of `rows` rows over several sequences took `seconds`."""
        t = self._timed(("pass", rows), seconds)
        if t is not None:
            self.t_pass[rows] = t
        self._tick()

    def record_drafts(self, source: str, drafted: int, accepted: int, draft_s: float) -> None:
        """A round of one sequence in a batched step: its acceptance and drafting cost (its pass is the batch's)."""
        t = self._timed(("draft", source), self._unit(source, draft_s, drafted))
        if t is not None:
            self.t_draft[source] = t
        self.since[source] = 0
        self._record_acceptance(source, drafted, accepted)

    def record_catch_up(self, source: str, tokens: int, seconds: float, first: bool = False) -> float:
        """A drafter took in `tokens` tokens it had not seen in `seconds` (Proposal.caught_up, catch_up_s). Returns
        what of it is its round's cost (record_round's catch_up_s): none where it was a start (its first round of a
        generation, or START tokens or more: a prompt, its window, a long run of plain steps), which pays_back
        weighed when it was decided."""
        if tokens >= FEED_MIN:
            t = self._timed(("feed", source), seconds / tokens)
            if t is not None:
                self.t_feed[source] = t
        return 0.0 if first or tokens >= START else seconds

    def feed_seconds(self, source: str) -> float | None:
        """Seconds a drafter of `source` takes per token it catches up on: measured, else the machine's price of a
        catch-up pass (Prior), else a PREFILL_ROW share of its drafted token's, else unknown."""
        if source in self.t_feed:
            return self.t_feed[source]
        if self._priced(source) and self.t_plain is not None:
            return self._prior_draft(source, CHUNK) / CHUNK
        return PREFILL_ROW * self.t_draft[source] if source in self.t_draft else None

    # ---- the machine's prices before a timing (Prior) -------------------------------------------------------

    def _priced(self, source: str) -> bool:
        """Whether `source` has a price before its drafting is timed."""
        return self.prior is not None and (source in self.prior.drafts or source in self.prior.free)

    def _other(self) -> float:
        """What a one-row step of the target costs beyond its weights, by the plain steps timed."""
        return max(0.0, self.t_plain - self.prior.target(1))

    def _prior_pass(self, rows: int) -> float:
        """A target pass of `rows` rows by the machine's prices (where plain steps were timed)."""
        return self.prior.target(rows) + self._other() * (1 + OTHER_ROW * (rows - 1))

    def _prior_draft(self, source: str, rows: int = 1) -> float:
        """A pass of `rows` rows of the source's draft model by the machine's prices (0 for lookup)."""
        if source in self.prior.free:
            return 0.0
        weights, layers = self.prior.drafts[source]
        return weights(rows) + self._other() * layers / self.prior.layers * (1 + OTHER_ROW * (rows - 1))

    def pays_back(self, source: str, k: int, lag: int, horizon: int | None) -> bool:
        """Whether drafting k tokens from `source` now, after first taking in the `lag` tokens it has not seen, is
        expected to save more than that catch-up costs over the `horizon` tokens still to come (yes where either cost
        is unknown: it is measured by doing it)."""
        per_token = self.feed_seconds(source)
        if lag <= CATCH_UP_FREE or horizon is None or per_token is None or not self.t_plain or k < 1:
            return True
        saving = horizon * (self.plain_seconds() - 1.0 / self.predicted_rate(source, k))
        return saving > START_MARGIN * lag * per_token

    def _unit(self, source: str, draft_s: float, drafted: int) -> float:
        """What t_draft counts of a round's drafting time: its share per drafted token, or the round's own."""
        return draft_s if source in self.per_round else draft_s / max(drafted, 1)

    def draft_seconds(self, source: str, k: int) -> float:
        """The estimated seconds of drafting k tokens from source: timed, else the machine's price (Prior), else 0."""
        t = self.t_draft.get(source)
        if t is None:
            t = self._prior_draft(source) if self._priced(source) and self.t_plain is not None else 0.0
        return (t if k > 0 else 0.0) if source in self.per_round else k * t

    def record_round(self, source: str, drafted: int, accepted: int, draft_s: float, verify_s: float,
                     catch_up_s: float = 0.0, rows: int | None = None) -> None:
        """draft_s: the drafting passes; catch_up_s: feeding the drafter first what it missed (not in draft_s);
        rows: a tree's drafted rows (drafted and accepted are then its chain's), timed apart from chains."""
        if source in self.resuming:  # a probe, or the round resuming speculation: its catch-up over the plain
            self.resuming.discard(source)  # steps (or a probe's window) is the cost of switching, not of a round,
            catch_up_s = 0.0  # which counts as none (so that a catch-up measured before fades while it is off)
            if self.t_plain and (accepted + 1) * self.t_plain > draft_s + verify_s:  # it beat a plain step: the
                self.probe_after.pop(source, None)  # next probe comes as soon as the first did, not later
        self.t_catch_up[source] = _ema(self.t_catch_up.get(source, catch_up_s), catch_up_s, CATCH_UP_EMA)
        self._tick(drafted=source)
        self.rounds_since_plain += 1
        if rows is not None:
            t = self._timed(("tree", rows), verify_s)
            if t is not None:
                self.t_tree[rows] = t
        else:
            t = self._timed(("verify", drafted), verify_s)
            if t is not None:
                self.t_verify[drafted] = t
        t = self._timed(("draft", source), self._unit(source, draft_s, drafted))
        if t is not None:
            self.t_draft[source] = t
        self._record_acceptance(source, drafted, accepted)

    def record_tree(self, source: str, kept: int | None) -> None:
        """A round that could have verified a tree: kept, the alternatives a tree round kept (0 or 1); None for a
        chain round."""
        if kept is None:
            self.since_tree[source] = self.since_tree.get(source, 0) + 1
            self.since_chain[source] = 0
            return
        self.since_tree[source] = 0
        self.since_chain[source] = self.since_chain.get(source, 0) + 1
        old = self.tree_gain.get(source)
        self.tree_gain[source] = float(kept) if old is None else _ema(old, float(kept), TREE_EMA)

    def branches(self, source: str, k: int, cfg: SpeculationConfig | None = None, probe: bool = True) -> int:
        """Candidates at the chain's least sure position (1: a chain alone) for a round of k drafts: cfg.tree where
        a tree measures faster than the chain, E[L](k) + the alternatives' kept share over the tree pass, and while
        a tree has not been measured lately (one round in TREE_PROBE after chains); a chain again after TREE_PROBE
        tree rounds, so that the chain's own cost stays measured. probe False (a sequence in a batch, whose pass
        times no round of its own): a tree only where one was measured faster."""
        cfg = cfg or self.cfg
        if cfg.tree <= 1 or k < 1:
            return 1
        if not cfg.adaptive:
            return cfg.tree
        gain = self.tree_gain.get(source)
        if not probe:
            if gain is None or self.t_plain is None:
                return 1
        elif self.since_chain.get(source, 0) >= TREE_PROBE:
            return 1
        elif gain is None or self.since_tree.get(source, 0) >= TREE_PROBE or self.t_plain is None:
            return cfg.tree
        tree_s = self.tree_seconds(k + cfg.tree - 1)
        cost = self.draft_seconds(source, k) + self.t_catch_up.get(source, 0.0)
        tree_rate = (self.expected_length(source, k) + gain) / (tree_s + cost)
        chain_rate = self.predicted_rate(source, k)
        self.tree_choice[source] = (cfg.tree, k, tree_rate, chain_rate)
        return cfg.tree if tree_rate > chain_rate else 1

    def tree_seconds(self, rows: int) -> float:
        """A tree pass of `rows` drafted rows: measured, else the nearest measured tree's scaled by the chain's
        verification cost between the two row counts, else a chain pass's of as many rows."""
        if rows in self.t_tree:
            return self._moved(("tree", rows), rows + 1, self.t_tree[rows])
        if self.t_tree:
            near = min(self.t_tree, key=lambda n: abs(n - rows))
            return (self._moved(("tree", near), near + 1, self.t_tree[near]) * self.verify_seconds(rows)
                    / max(self.verify_seconds(near), 1e-9))
        return self.verify_seconds(rows)

    def _record_acceptance(self, source: str, drafted: int, accepted: int) -> None:
        count_round(self.tried.setdefault(source, []), self.accepted.setdefault(source, []), drafted, accepted)

    # ---- estimates --------------------------------------------------------------------------

    def acceptance(self, source: str, k: int) -> list[float]:
        """Estimated a_1..a_k: per position where measured, else the source's pooled rate."""
        tried, acc = self.tried.get(source, []), self.accepted.get(source, [])
        pooled = (sum(acc) + 1) / (sum(tried) + 2)
        return [(acc[i] + pooled) / (tried[i] + 1) if i < len(tried) else pooled for i in range(k)]

    def expected_length(self, source: str, k: int) -> float:
        return speed.expected_length(self.acceptance(source, k))

    def verify_seconds(self, k: int) -> float:
        """Measured t_verify(k), else interpolated linearly between measured k (t_plain at k = 0), at the sequence's
        length now (_moved)."""
        if k in self.t_verify:
            return self._moved(("verify", k), k + 1, self.t_verify[k])
        return self._verify_between(k, self._verify_points())

    def _verify_points(self) -> list[tuple[int, float]]:
        """The measured (k, t_verify) moved to the sequence's length now, (0, t_plain) first: what verify_seconds
        interpolates between (computed once for every k a decision weighs)."""
        moved = {n: self._moved(("verify", n), n + 1, t) for n, t in self.t_verify.items()}
        return sorted({0: self.plain_seconds(), **moved}.items())

    def _verify_between(self, k: int, points: list[tuple[int, float]]) -> float:
        if k in self.t_verify:
            return dict(points)[k]
        below = [p for p in points if p[0] < k]
        above = [p for p in points if p[0] > k]
        if below and above:
            (k0, t0), (k1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        (k0, t0) = below[-1]
        if self.prior is not None:  # beyond what was timed: the machine's price of the rows between
            return t0 + self._prior_pass(k + 1) - self._prior_pass(k0 + 1)
        if len(below) >= 2:
            (ka, ta) = below[-2]
            slope = max((t0 - ta) / (k0 - ka), 0.0)
        else:
            slope = 0.1 * self.plain_seconds()  # without a price before two points exist: 10% of a step a token
        return t0 + slope * (k - k0)

    def predicted_rate(self, source: str, k: int) -> float:
        if k == 0:
            return 1.0 / self.plain_seconds()
        return speed.rate(self.acceptance(source, k), self.verify_seconds(k), self.draft_seconds(source, k) / k,
                          self.t_catch_up.get(source, 0.0))

    def predicted_rates(self, source: str, top: int) -> list[float]:
        """predicted_rate(source, k) for k = 1..top, the same figures, each price computed once (a step weighs every
        k: this is its hot path)."""
        acceptance, points = self.acceptance(source, top), self._verify_points()
        catch_up = self.t_catch_up.get(source, 0.0)
        rates, expected, run = [], 1.0, 1.0
        for k in range(1, top + 1):
            run *= acceptance[k - 1]
            expected += run  # (speed.expected_length's sum, in its order)
            rounds = speed.round_seconds(self._verify_between(k, points), k, self.draft_seconds(source, k) / k,
                                         catch_up)
            rates.append(expected / rounds)
        return rates

    def pass_seconds(self, rows: int) -> float | None:
        """Measured seconds of a batched pass of `rows` rows, else interpolated linearly between measured row
        counts; beyond them, from the nearest measured one (a plain step for one row) by the machine's prices of the
        rows between (Prior), or without a price extrapolated from the last two (before a second point: each row
        beyond costs what one more verified token costs a sequence alone, else 10% of a plain step); None before any
        batched pass without a price."""
        if rows in self.t_pass:
            return self.t_pass[rows]
        points = sorted(self.t_pass.items())
        below = [p for p in points if p[0] < rows]
        above = [p for p in points if p[0] > rows]
        if below and above:
            (r0, t0), (r1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        if self.prior is not None and self.t_plain is not None:
            r0, t0 = below[-1] if below else above[0] if above and above[0][0] - rows < rows - 1 else (1, self.t_plain)
            return max(t0 + self.prior.target(rows) - self.prior.target(r0) + self._other() * OTHER_ROW * (rows - r0),
                       1e-9)
        if not points:
            return None
        if len(points) >= 2:
            (ra, ta), (rb, tb) = (points[-2], points[-1]) if below else (points[0], points[1])
            slope = max((tb - ta) / (rb - ra), 0.0)
        elif self.t_plain and self.t_verify:
            k, t = max(self.t_verify.items())
            slope = max((t - self.t_plain) / k, 0.0)
        else:
            slope = 0.1 * (self.t_plain or points[0][1] / points[0][0])
        r0, t0 = below[-1] if below else above[0]
        return max(t0 + slope * (rows - r0), 1e-9)

    def k_in_batch(self, source: str, cfg: SpeculationConfig, plan: "BatchPlan", limit: int,
                   own: "Acceptance | None" = None, lag: int = 0, horizon: int | None = None) -> int:
        """The k for one sequence of a batched step, given what the sequences planned before it draft (plan): the
        one that maximises the step's expected tokens per second over the whole batch, 0 included (a step of
        plain decoding for every sequence when the batch already fills the compute). A source whose drafting has
        not been timed yet drafts here only where it has nothing to take in first (n-gram lookup; a draft model is
        timed by the steps of a sequence alone, or priced by the machine's calibration). Where none pays, a probe
        that is due (probe) drafts for the first sequence planned that may, one a step. own: this sequence's
        acceptance of the source so far (weighed against the pooled estimate); lag: tokens the drafter must take
        in before it drafts (a pass over them); horizon: the tokens still to come, over which that must pay back."""
        top = min(cfg.draft_max, limit)
        if not cfg.adaptive or cfg.draft_min > 0:
            return max(0, min(cfg.draft_max if not cfg.adaptive else cfg.draft_min, limit))
        self.since.setdefault(source, 0)
        if (top <= 0 or (source not in self.t_draft and not self._priced(source) and lag > 0)
                or plan.seconds(0, 0.0) is None):
            return 0
        pooled = self.acceptance(source, top)
        rates = own.rates(source, pooled) if own is not None else pooled
        # a round's own catch-up is its step's cost; a start's (START tokens or more) is weighed over the tokens still
        # to come, the whole batch waiting for it (every sequence of the step)
        start = lag >= START
        catch_up = lag * (self.feed_seconds(source) or 0.0) if CATCH_UP_FREE < lag < START else 0.0
        best, best_rate = 0, plan.tokens / plan.seconds(0, 0.0)
        expected, run = plan.tokens, 1.0
        for k in range(1, top + 1):
            run *= rates[k - 1]
            expected += run  # the batch's tokens if this sequence drafts k
            rate = expected / plan.seconds(k, self.draft_seconds(source, k), catch_up, source)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and plan.probed is None and self.t_plain is not None:
            best = self.probe(source, cfg, top, lag, max(1, round(plan.base_tokens)))
            plan.probed = source if best else None
            return self._why(source, best, "probe")
        waiting = max(1, round(plan.base_tokens))
        return self._why(source, best if not start or self.pays_back(source, best, lag * waiting, horizon) else 0,
                         "gain")

    # ---- the decision -----------------------------------------------------------------------

    def step(self, decoding: int, prefilling: bool, max_rows: int, shared: frozenset = frozenset()) -> "StepPlan":
        """The plan of one engine step (StepPlan): `decoding` sequences decode, a prompt prefills beside them where
        `prefilling`, in passes of at most max_rows rows; shared: the sources whose passes run as one (BatchPlan)."""
        return StepPlan(self, decoding, prefilling, max_rows, shared)

    def k_for(self, source: str, cfg: SpeculationConfig | None = None, lag: int = 0, horizon: int | None = None) -> int:
        """The k to draft now from `source`; cfg (e.g. one request's settings) bounds it instead of self.cfg. lag: the
        tokens its drafter must take in first; horizon: the tokens still to come (a catch-up that does not pay back
        over them is not started: pays_back)."""
        cfg = cfg or self.cfg
        if not cfg.adaptive:
            return cfg.draft_max
        if self.t_plain is None:  # measure plain steps first (draft_min > 0 forbids plain steps)
            return 0 if cfg.draft_min == 0 else cfg.draft_max
        self.since.setdefault(source, 0)
        if source not in self.t_draft and not self._priced(source):  # neither timed nor priced yet: probe
            return self._why(source, max(cfg.draft_min, min(cfg.draft_max, PROBE_K)), "unpriced")
        rates = self.predicted_rates(source, cfg.draft_max)
        best = max(range(max(cfg.draft_min, 1), cfg.draft_max + 1), key=lambda k: rates[k - 1], default=0)
        gain = rates[best - 1] / self.predicted_rate(source, 0) if best else 0.0
        if cfg.draft_min == 0 and self.rounds_since_plain >= (REFRESH if gain >= MARGIN else REFRESH_NEAR):
            return 0  # time a plain step again
        if cfg.draft_min == 0 and gain <= 1.0:
            self.resuming.add(source)
            return self._why(source, self.probe(source, cfg, best, lag), "probe")
        if cfg.draft_min == 0 and not self.pays_back(source, best, lag, horizon):
            return 0  # its catch-up would cost more than it saves: not started (another source may draft)
        self.probe_after.pop(source, None)  # speculation wins: probe promptly again once it stops winning
        return self._why(source, best, "gain" if cfg.draft_min == 0 else "draft_min")

    def _why(self, source: str, k: int, reason: str) -> int:
        """k, counted under the reason it was chosen (where it drafts): "gain" (its predicted rate beats plain
        decoding), "probe" (it does not, and a probe was due), "unpriced" (neither timed nor priced yet), "draft_min"
        (plain steps forbidden). The statistics carry the counts (snapshot: reasons)."""
        if k > 0:
            counts = self.reasons.setdefault(source, {})
            counts[reason] = counts.get(reason, 0) + 1
            self.last_reason[source] = reason
        return k

    def gain(self, source: str, cfg: SpeculationConfig | None = None) -> float:
        """The best predicted speed-up of drafting from `source` over plain decoding now (0 before a plain step)."""
        cfg = cfg or self.cfg
        if self.t_plain is None:
            return 0.0
        return max(self.predicted_rates(source, cfg.draft_max)) * self.plain_seconds()

    def probe(self, source: str, cfg: SpeculationConfig, best: int, lag: int, waiting: int = 1) -> int:
        """Where plain decoding wins over `source`: the k of a probe of it if one is due (a short round, to measure its
        acceptance again: it may have become worth drafting), else 0. One is due once the source has sat out the
        steps its last probes set (probe_every, doubled by each probe that lost, at most PROBE_MAX) and as many as its
        expected loss allows (_probe_wait); never one whose catch-up would take seconds (a draft model's window of a
        long prompt: lag, what this round would feed it). waiting: the sequences its drafting holds up (a batch's)."""
        wait = max(self.probe_after.get(source, cfg.probe_every), waiting * self._probe_wait(source, lag))
        if self.since.get(source, 0) < wait:
            return 0
        if lag >= START and lag * (self.feed_seconds(source) or 0.0) > PROBE_CATCH_UP * self.plain_seconds():
            return 0  # (not counted as a probe: the wait is not doubled)
        self.probe_after[source] = min(2 * wait, max(PROBE_MAX, cfg.probe_every))  # next time, wait longer
        return max(1, min(best, PROBE_SHORT)) if best else 0

    def _probe_wait(self, source: str, lag: int) -> int:
        """Steps between probes of `source` so that they cost at most PROBE_SHARE of the time: a probe's expected loss
        (its catch-up of `lag` tokens, PROBE_SHORT drafts and their verification, less the plain steps the tokens it
        is expected to emit would have taken) over PROBE_SHARE of a plain step; at most PROBE_LIMIT."""
        plain = self.plain_seconds()
        k = PROBE_SHORT
        loss = (lag * (self.feed_seconds(source) or 0.0) + self.draft_seconds(source, k) + self.verify_seconds(k)
                - self.expected_length(source, k) * plain)
        return min(PROBE_LIMIT, max(0, int(loss / (PROBE_SHARE * plain))))

    def snapshot(self) -> dict:
        """The measured model, for the statistics: r, v(k), per-position acceptance."""
        t1 = self.t_plain or 0.0
        return {
            "t_plain_s": self.t_plain,
            "v": {k: t / t1 for k, t in sorted(self.t_verify.items())} if t1 else {},
            "r": {s: t / t1 for s, t in self.t_draft.items()} if t1 else {},  # per round for per_round's sources
            "per_round": sorted(self.per_round),
            "catch_up": {s: t / t1 for s, t in self.t_catch_up.items()} if t1 else {},
            "acceptance": {s: self.acceptance(s, len(self.tried[s])) for s in self.tried},
            "reasons": {s: dict(r) for s, r in self.reasons.items()},
            "gain": {s: self.gain(s) for s in self.tried} if t1 else {},
            **({"v_tree": {n: t / t1 for n, t in sorted(self.t_tree.items())} if t1 else {},
                "tree_gain": dict(self.tree_gain)} if self.tree_gain else {}),
        }


def attention_rows(rows: int) -> float:
    """What a pass of `rows` rows costs the attention kernel over the positions, in one row's reading of them."""
    return 1 + ATTENTION_ROW * (rows - 1)


def count_round(tried: list[float], accepted: list[float], drafted: int, kept: int) -> None:
    """A round's drafts into decayed counts per position: each count forgets DECAY of itself, then every position up
    to the first rejection was judged (tried) and those before it kept."""
    for i in range(len(tried)):
        tried[i] *= DECAY
        accepted[i] *= DECAY
    while len(tried) < drafted:
        tried.append(0.0)
        accepted.append(0.0)
    for i in range(min(drafted, kept + 1)):  # positions past the first rejection were not judged
        tried[i] += 1
        accepted[i] += i < kept


def _ema(old: float, new: float, weight: float) -> float:
    return (1 - weight) * old + weight * new


class BatchPlan:
    """The rows of one batched step as its sequences are planned in turn (engine.Batch): each sequence's k is chosen
    by AdaptivePolicy.k_in_batch given the choices made before it (the rows of every sequence count from the start:
    one each, and a prefilling sequence's chunk)."""

    def __init__(self, policy: AdaptivePolicy, rows: int, sequences: int, max_rows: int,
                 shared: frozenset = frozenset()):
        """shared: the sources whose drafting runs as one pass for every sequence of the step (a draft model's on the
        CPU: engine.Engine.plan), so the step waits for the longest of their rounds, not for their sum."""
        self.policy, self.max_rows, self.shared = policy, max_rows, shared
        self.base_rows, self.base_tokens = rows, float(sequences)
        # sequence -> (k, expected extra tokens, drafting s, catch-up s, source)
        self.choices: dict[int, tuple[int, float, float, float, str]] = {}
        self.extra: dict[int, int] = {}  # sequence -> rows of a tree's alternatives beside its chain
        self.passes: dict[int, float | None] = {}  # rows -> the policy's estimate of a pass, asked once a step
        self.probed: str | None = None  # the source a sequence of this step probes (one probe a step at most)

    @property
    def rows(self) -> int:
        return self.base_rows + sum(c[0] for c in self.choices.values()) + sum(self.extra.values())

    @property
    def tokens(self) -> float:
        return self.base_tokens + sum(c[1] for c in self.choices.values())

    def seconds(self, extra_rows: int, extra_draft_s: float, extra_catch_up_s: float = 0.0,
                source: str | None = None) -> float | None:
        """The step's expected seconds: its pass of the rows planned (and extra_rows more), the catch-ups, and the
        drafting (a shared source's rounds as one: the longest)."""
        rows = self.rows + extra_rows
        if rows not in self.passes:  # the plan asks for the same few row counts for every sequence of the step
            self.passes[rows] = self.policy.pass_seconds(rows)
        t = self.passes[rows]
        if t is None:
            return None
        drafting = [(d, src) for _, _, d, _, src in self.choices.values()] + [(extra_draft_s, source)]
        alone = sum(d for d, src in drafting if src not in self.shared)
        together = max((d for d, src in drafting if src in self.shared), default=0.0)
        return t + alone + together + sum(c[3] for c in self.choices.values()) + extra_catch_up_s

    def branches(self, source: str, width: int, cfg: SpeculationConfig) -> int:
        """Candidates a sequence's tree may have in this step (its k already chosen): as many as the pass has rows left
        for, and with the adaptive policy only where the batch's tokens per second gain from them (the candidates'
        measured kept share against the pass's cost of their rows), else 1: a chain."""
        width = min(width, 1 + max(0, self.max_rows - self.rows))
        if width < 2 or not cfg.adaptive:
            return width
        gain = self.policy.tree_gain.get(source)
        now, more = self.seconds(0, 0.0), self.seconds(width - 1, 0.0)
        if gain is None or not now or not more:
            return 1
        return width if (self.tokens + gain) / more > self.tokens / now else 1

    def k_for(self, key: int, cfg: SpeculationConfig, budget: int, own: "Acceptance | None" = None,
              lag=lambda source: 0, horizon: int | None = None):
        """The KFor of the sequence `key` (its drafter asks per source; its last answer is the one that counts): own,
        its acceptance so far; lag(source), what that source's drafter must take in first."""
        def choose(source: str) -> int:
            self.choices.pop(key, None)
            behind = lag(source)
            k = self.policy.k_in_batch(source, cfg, self, min(budget, self.max_rows - self.rows), own, behind, horizon)
            if k > 0:
                rates = self.policy.acceptance(source, k)
                rates = own.rates(source, rates) if own is not None else rates
                catch_up = behind * (self.policy.feed_seconds(source) or 0.0) if behind > CATCH_UP_FREE else 0.0
                # (a start's catch-up too: the step's pass waits for it)
                self.choices[key] = (k, speed.expected_length(rates) - 1, self.policy.draft_seconds(source, k),
                                     catch_up, source)
            return k
        return choose


class Acceptance:
    """One sequence's own acceptance per source and draft position (decayed as the policy's), for BatchPlan."""

    def __init__(self):
        self.tried: dict[str, list[float]] = {}
        self.accepted: dict[str, list[float]] = {}

    def record(self, source: str, drafted: int, accepted: int) -> None:
        count_round(self.tried.setdefault(source, []), self.accepted.setdefault(source, []), drafted, accepted)

    def rates(self, source: str, pooled: list[float]) -> list[float]:
        """Per position: this sequence's rate, weighed against the pooled estimate (OWN_PRIOR rounds' worth)."""
        tried, acc = self.tried.get(source, []), self.accepted.get(source, [])
        return [(acc[i] + OWN_PRIOR * p) / (tried[i] + OWN_PRIOR) if i < len(tried) else p
                for i, p in enumerate(pooled)]


class StepPlan:
    """The policy's side of one engine step: each decoding sequence's k and tree chosen, and what its round cost and
    kept recorded. A sequence alone in its step follows the rules for one sequence (AdaptivePolicy.k_for, its rounds
    timing verifications and plain steps); several plan their rows together (BatchPlan: the step's expected tokens
    per second), their pass timed by its rows. The engine asks the same questions either way."""

    def __init__(self, policy: AdaptivePolicy, decoding: int, prefilling: bool, max_rows: int,
                 shared: frozenset = frozenset()):
        """decoding: the step's decoding sequences; prefilling: whether a prompt's chunk shares the pass; shared: the
        sources whose draft passes run as one for every sequence (BatchPlan)."""
        self.policy = policy
        self.alone = decoding == 1 and not prefilling
        self.batch = None if self.alone else BatchPlan(policy, decoding + prefilling, decoding, max_rows, shared)

    def k_for(self, index: int, s, budget: int, lag, horizon: int | None) -> "KFor":
        """The KFor of the sequence `s` planned `index`-th (its speculation settings, its acceptance so far, its
        length): at most budget; lag(source): what that source's drafter must take in first; horizon: the tokens
        still to come."""
        policy, position = self.policy, len(s.tokens)
        if self.batch is not None:
            choose = self.batch.k_for(index, s.speculation, budget, s.acceptance, lag, horizon)
        else:
            def choose(source: str) -> int:
                return max(0, min(policy.k_for(source, s.speculation, lag(source), horizon), budget))

        def at_position(source: str) -> int:
            policy.position = position  # the length its choice is for
            return choose(source)
        return at_position

    def branches(self, index: int, source: str, k: int, width: int, cfg: SpeculationConfig) -> int:
        """Candidates beside a chain of k drafts (1: the chain alone), at most width."""
        width = min(self.policy.branches(source, k, cfg, probe=self.batch is None), width)
        return self.batch.branches(source, width, cfg) if self.batch is not None and width > 1 else width

    def drafted(self, index: int, proposal) -> None:
        """A round's proposal is known: a tree's alternatives take rows the next sequences' plans count."""
        if self.batch is not None and proposal.parents is not None:
            self.batch.extra[index] = len(proposal.tokens) - proposal.chain

    def record_plain(self, seconds: float, position: int) -> None:
        """A plain step took `seconds` (its pass's share and any drafting it did) at the sequence's length."""
        if self.alone:
            self.policy.position = position
            self.policy.record_plain(seconds)

    def record_round(self, source: str, drafted: int, accepted: int, draft_s: float, verify_s: float,
                     catch_up_s: float, position: int, tree_rows: int | None = None, tree_kept: int | None = None,
                     tree_possible: bool = False) -> None:
        """A round of `drafted` drafts (a tree's: its chain's; tree_rows its drafted rows, tree_kept the alternatives
        kept) kept `accepted`; draft_s its drafting, verify_s its pass (a sequence alone: the step's pass is its
        verification), catch_up_s what of its catch-up is its own cost (record_catch_up). tree_possible: a chain round
        where a tree could have run."""
        policy = self.policy
        policy.position = position
        if self.alone:
            policy.record_round(source, drafted, accepted, draft_s, verify_s, catch_up_s, rows=tree_rows)
        else:
            policy.record_drafts(source, drafted, accepted, draft_s)
        if tree_kept is not None:
            policy.record_tree(source, tree_kept)
        elif tree_possible and self.alone:
            policy.record_tree(source, None)

    def record_pass(self, rows: int, seconds: float, sequences: int) -> None:
        """The step's target pass: `rows` rows of `sequences` sequences took `seconds` (several: a batched pass)."""
        if sequences > 1:
            self.policy.record_pass(rows, seconds)
