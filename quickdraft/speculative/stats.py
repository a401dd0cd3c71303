"""What speculation did in one generation, in the names llama.cpp's users read plus ours."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    drafter: str = "none"
    draft_device: str | None = None
    rounds: int = 0  # speculative rounds (a plain step is not a round)
    plain_steps: int = 0
    draft_n: int = 0  # tokens drafted
    draft_n_accepted: int = 0
    emitted_in_rounds: int = 0  # tokens emitted by rounds: accepted drafts + one from the target each
    position_tried: list[int] = field(default_factory=list)  # per draft position i: rounds that drafted it
    position_accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_s: float = 0.0
    k_history: list[int] = field(default_factory=list)  # k chosen each round or step (0: plain)
    sources: Counter = field(default_factory=Counter)  # rounds per source
    drafted_by: Counter = field(default_factory=Counter)  # tokens drafted per source
    accepted_by: Counter = field(default_factory=Counter)  # of them, accepted
    reasons: dict = field(default_factory=dict)  # source -> Counter of why its rounds were drafted (policy._why)
    policy: dict = field(default_factory=dict)  # the policy's measured model: r, v(k), acceptance
    constraint: str | None = None  # the kind of grammar the output followed, if any
    mask_s: float = 0.0  # time computing grammar masks (verification's overlaps the target pass)
    masks_computed: int = 0
    tree_rounds: int = 0  # rounds that verified a tree (--draft-tree)
    tree_alternatives_kept: int = 0  # of them, rounds that kept an alternative candidate
    tree_note: str | None = None  # where trees were asked for and none was verified: why

    def record_round(self, source: str, drafted: int, accepted: int, emitted: int,
                     draft_s: float, verify_s: float, reason: str | None = None) -> None:
        self.rounds += 1
        self.reasons.setdefault(source, Counter())[reason or "fixed"] += 1
        self.sources[source] += 1
        self.drafted_by[source] += drafted
        self.accepted_by[source] += accepted
        self.draft_n += drafted
        self.draft_n_accepted += accepted
        self.emitted_in_rounds += emitted
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.k_history.append(drafted)
        while len(self.position_tried) < drafted:
            self.position_tried.append(0)
            self.position_accepted.append(0)
        for i in range(drafted):
            self.position_tried[i] += 1
            self.position_accepted[i] += i < accepted

    def record_plain(self, seconds: float) -> None:
        self.plain_steps += 1
        self.plain_s += seconds
        self.k_history.append(0)

    def by_source(self) -> dict:
        """Per source: its rounds, drafts, accepted drafts, acceptance and mean accepted length (tokens a round of it
        emitted: its kept drafts and the target's one), why its rounds drafted (reasons: "gain", "probe", ...; "fixed"
        without the adaptive policy); and the best speed-up over plain decoding the policy predicts for it alone at
        the end (predicted_gain)."""
        gains = self.policy.get("gain", {}) if self.policy else {}
        return {source: {"rounds": n, "drafted": self.drafted_by[source], "accepted": self.accepted_by[source],
                         "acceptance_rate": self.accepted_by[source] / self.drafted_by[source]
                         if self.drafted_by[source] else 0.0,
                         "mean_accepted_length": 1 + self.accepted_by[source] / n,
                         "reasons": dict(self.reasons.get(source, {})),
                         "predicted_gain": gains.get(source)}
                for source, n in self.sources.items()}

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative round (accepted drafts + the target's own token)."""
        return self.emitted_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        """Of the rounds that drafted position i, the share that accepted it."""
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    @property
    def mask_share(self) -> float:
        """Grammar mask time over the time of all rounds and plain steps."""
        total = self.draft_s + self.verify_s + self.plain_s
        return self.mask_s / total if total > 0 else 0.0

    @property
    def k_mean(self) -> float:
        return sum(self.k_history) / len(self.k_history) if self.k_history else 0.0

    def to_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "draft_device": self.draft_device,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "accept_per_position": self.accept_per_position,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "plain_s": self.plain_s,
            "k_history": self.k_history,
            "rounds_by_source": dict(self.sources),
            "drafted_by_source": dict(self.drafted_by),
            "by_source": self.by_source(),
            "policy": self.policy,
            "constraint": self.constraint,
            "mask_s": self.mask_s,
            "masks_computed": self.masks_computed,
            "mask_share": self.mask_share,
            "tree_rounds": self.tree_rounds,
            "tree_alternatives_kept": self.tree_alternatives_kept,
            "tree_note": self.tree_note,
        }

    def summary(self) -> str:
        if self.drafter == "none":
            line = "speculation off"
        else:
            line = (f"spec[{self.drafter}]: {self.draft_n_accepted}/{self.draft_n} drafts accepted "
                    f"({100 * self.acceptance_rate:.0f}%), {self.mean_accepted_length:.2f} tokens/round over "
                    f"{self.rounds} rounds + {self.plain_steps} plain steps, mean k {self.k_mean:.1f}, "
                    f"draft {self.draft_s:.2f} s / verify {self.verify_s:.2f} s")
        if self.constraint:
            line += (f"; {self.constraint} constraint: {self.masks_computed} masks in {self.mask_s * 1e3:.1f} ms "
                     f"({100 * self.mask_share:.1f}% of decoding)")
        return line
