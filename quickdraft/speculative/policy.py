"""How many tokens to draft now: the k that maximises expected tokens per second, by measurement.

The policy measures what the speed model (speculative/speed.py) needs as the engine runs: a plain step, the
verification of k drafts, a drafted token's cost per source and the acceptance of each draft position; it picks
the best k, 0 (plain) included, probing now and then so that it can switch back.
"""

from __future__ import annotations

from quickdraft.config import SpeculationConfig
from quickdraft.speculative import speed

EMA = 0.25  # weight of a new timing
DECAY = 0.97  # per-round forgetting of acceptance counts (about the last 30 rounds matter)
PROBE_K = 4  # the first round of a source not yet measured
# While plain decoding wins, a source is probed after probe_every plain steps, then after twice as many each time
# a probe finds plain decoding still better (at most PROBE_MAX; each generation starts over), with at most
# PROBE_SHORT drafts: a probe costs a
# round that is expected to lose (a draft model's catch-up pass over the steps it missed, its drafts, a verification),
# and probing at a fixed interval made adaptive decoding 10-20% slower than plain where speculation does not pay.
PROBE_MAX = 256
PROBE_SHORT = 2
# While speculation wins, one plain step after this many rounds in a row times a plain step again: t_plain is
# measured only on plain steps, and a stale one (taken while the machine was slower, or before its caches were
# warm) can hold the policy speculating where plain decoding has become faster. One plain step in 64 rounds
# costs well under 1% where speculation wins by 1.2x or more.
REFRESH = 64


class AdaptivePolicy:
    def __init__(self, cfg: SpeculationConfig):
        self.cfg = cfg
        self.t_plain: float | None = None
        self.t_verify: dict[int, float] = {}  # k -> seconds to verify k drafts (k + 1 tokens)
        self.t_draft: dict[str, float] = {}  # source -> seconds per drafted token
        self.tried: dict[str, list[float]] = {}  # source -> decayed count of rounds reaching position i
        self.accepted: dict[str, list[float]] = {}
        self.plain_since_round = 0
        self.rounds_since_plain = 0
        self.probe_after: dict[str, int] = {}  # source -> plain steps before its next probe (backing off)
        self.warmed: set = set()  # timings seen once: the first of each kind pays one-off kernel setup

    def begin(self) -> None:
        """A new generation: its text may draft better or worse than the last one's, so probing starts over at
        probe_every (the timings and acceptance measured so far are kept)."""
        self.probe_after.clear()

    def _warm(self, key) -> bool:
        """False the first time `key` is timed (that sample is dropped), True after."""
        if key in self.warmed:
            return True
        self.warmed.add(key)
        return False

    # ---- measurements -----------------------------------------------------------------------

    def record_plain(self, seconds: float) -> None:
        if self._warm("plain"):
            self.t_plain = _ema(self.t_plain, seconds)
        self.plain_since_round += 1
        self.rounds_since_plain = 0

    def record_round(self, source: str, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.plain_since_round = 0
        self.rounds_since_plain += 1
        if self._warm(("verify", drafted)):
            self.t_verify[drafted] = _ema(self.t_verify.get(drafted), verify_s)
        if self._warm(("draft", source)):
            self.t_draft[source] = _ema(self.t_draft.get(source), draft_s / max(drafted, 1))
        tried = self.tried.setdefault(source, [])
        acc = self.accepted.setdefault(source, [])
        for i in range(len(tried)):
            tried[i] *= DECAY
            acc[i] *= DECAY
        while len(tried) < drafted:
            tried.append(0.0)
            acc.append(0.0)
        for i in range(min(drafted, accepted + 1)):  # positions past the first rejection were not judged
            tried[i] += 1
            acc[i] += i < accepted

    # ---- estimates --------------------------------------------------------------------------

    def acceptance(self, source: str, k: int) -> list[float]:
        """Estimated a_1..a_k: per position where measured, else the source's pooled rate."""
        tried, acc = self.tried.get(source, []), self.accepted.get(source, [])
        pooled = (sum(acc) + 1) / (sum(tried) + 2)
        return [(acc[i] + pooled) / (tried[i] + 1) if i < len(tried) else pooled for i in range(k)]

    def expected_length(self, source: str, k: int) -> float:
        return speed.expected_length(self.acceptance(source, k))

    def verify_seconds(self, k: int) -> float:
        """Measured t_verify(k), else interpolated linearly between measured k (t_plain at k = 0)."""
        if k in self.t_verify:
            return self.t_verify[k]
        points = sorted({0: self.t_plain, **self.t_verify}.items())
        below = [p for p in points if p[0] < k]
        above = [p for p in points if p[0] > k]
        if below and above:
            (k0, t0), (k1, t1) = below[-1], above[0]
            return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        (k0, t0) = below[-1]
        if len(below) >= 2:
            (ka, ta) = below[-2]
            slope = max((t0 - ta) / (k0 - ka), 0.0)
        else:
            slope = 0.1 * self.t_plain  # prior before two points exist: each extra token costs 10% of a step
        return t0 + slope * (k - k0)

    def predicted_rate(self, source: str, k: int) -> float:
        if k == 0:
            return 1.0 / self.t_plain
        return speed.rate(self.acceptance(source, k), self.verify_seconds(k), self.t_draft.get(source, 0.0))

    # ---- the decision -----------------------------------------------------------------------

    def k_for(self, source: str, cfg: SpeculationConfig | None = None) -> int:
        """The k to draft now from `source`; cfg (e.g. one request's settings) bounds it instead of self.cfg."""
        cfg = cfg or self.cfg
        if not cfg.adaptive:
            return cfg.draft_max
        if self.t_plain is None:  # measure plain steps first (draft_min > 0 forbids plain steps)
            return 0 if cfg.draft_min == 0 else cfg.draft_max
        if source not in self.t_draft:  # not measured yet (or only its warm-up round): probe
            return max(cfg.draft_min, min(cfg.draft_max, PROBE_K))
        if cfg.draft_min == 0 and self.rounds_since_plain >= REFRESH:  # time a plain step again (every source
            return 0  # of this step hears the same, so the step is plain)
        candidates = range(max(cfg.draft_min, 1), cfg.draft_max + 1)
        best = max(candidates, key=lambda k: self.predicted_rate(source, k), default=0)
        if cfg.draft_min == 0 and self.predicted_rate(source, 0) >= self.predicted_rate(source, best):
            wait = self.probe_after.get(source, cfg.probe_every)
            if self.plain_since_round < wait:
                return 0
            self.probe_after[source] = min(2 * wait, max(PROBE_MAX, cfg.probe_every))  # next time, wait longer
            return min(best, PROBE_SHORT)
        self.probe_after.pop(source, None)  # speculation wins: probe promptly again once it stops winning
        return best

    def snapshot(self) -> dict:
        """The measured model, for the statistics: r, v(k), per-position acceptance."""
        t1 = self.t_plain or 0.0
        return {
            "t_plain_s": self.t_plain,
            "v": {k: t / t1 for k, t in sorted(self.t_verify.items())} if t1 else {},
            "r": {s: t / t1 for s, t in self.t_draft.items()} if t1 else {},
            "acceptance": {s: self.acceptance(s, len(self.tried[s])) for s in self.tried},
        }


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
