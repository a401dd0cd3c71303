"""`quickdraft tune`: measure each candidate draft, fit the speed model, predict the best draft and k,
check the prediction with a short run, and write a profile that `generate` and `serve` take.

The speed model (DESIGN.md): with t_plain one target step, v(k) = t_verify(k) / t_plain the cost of
verifying k drafts (k + 1 tokens), r = t_draft / t_plain the cost of one drafted token, and a_i the
acceptance of draft position i given the ones before were accepted, a round emits
E[L](k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens, so speculation runs at
speed-up(k) = E[L](k) / (v(k) + k r) times plain decoding. A drafter that proposes only sometimes (n-gram
lookup needs a match) runs rounds on a share c of its steps and plain steps on the rest:
speed-up(k) = (c E[L](k) + 1 - c) / (c (v(k) + k r) + 1 - c).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quickdraft.config import SamplingParams, SpecConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.spec.build import draft_model_of

PROFILE_VERSION = 1


@dataclass
class Candidate:
    name: str  # a draft model spec, "ngram", or "MODEL+ngram"
    r: float  # drafted token cost / target step
    acceptance: list[float]  # a_1..a_kmax, conditional per position
    coverage: float = 1.0  # share of steps on which the drafter proposed something
    predicted: dict[int, float] = field(default_factory=dict)  # k -> speed-up
    best_k: int = 0
    best_speedup: float = 0.0
    why_not: str = ""


def _time(fn, reps: int) -> float:
    fn()  # warm-up: one-off kernel setup
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def verify_costs(target, prompt: list[int], kmax: int, reps: int = 3) -> tuple[float, dict[int, float]]:
    """t_plain and v(k) for k = 1..kmax: target passes over k + 1 tokens after the prompt, cache rolled back."""
    model, device = target.model, target.device
    cache = KVCache.for_model(model, len(prompt) + kmax + 2)
    model(torch.tensor([prompt], device=device), cache, last_only=True)
    n = len(prompt)
    feed = torch.tensor([prompt[-1:] * (kmax + 1)], device=device)

    def step(k):
        def go():
            cache.rollback(n)
            model(feed[:, : k + 1], cache)
        return go

    t_plain = _time(step(0), reps)
    return t_plain, {k: _time(step(k), reps) / t_plain for k in range(1, kmax + 1)}


@torch.inference_mode()
def draft_cost(drafter, prompt: list[int], reps: int = 3) -> float:
    """Seconds per drafted token of a draft model (0 for n-gram lookup)."""
    draft = draft_model_of(drafter)
    if draft is None:
        return 0.0
    model = draft.model
    device = model.tok_embeddings.weight.device
    cache = KVCache.for_model(model, len(prompt) + 2)
    model(torch.tensor([prompt], device=device), cache, last_only=True)
    feed = torch.tensor([prompt[-1:]], device=device)

    def go():
        cache.rollback(len(prompt))
        model(feed, cache, last_only=True)
    return _time(go, reps)


def acceptance(target, drafter, prompts: dict[str, list[int]], kmax: int, n: int) -> tuple[list[float], float]:
    """Per-position acceptance of greedy drafts at fixed k = kmax over the prompts (pooled), and the share of
    steps that were rounds (the rest: the drafter had nothing to propose)."""
    engine = Engine(target, target.model.max_context, drafter, SpecConfig(draft_max=kmax, adaptive=False, p_min=0.0))
    tried, accepted = [0] * kmax, [0] * kmax
    rounds = plain = 0
    for prompt in prompts.values():
        events = list(engine.generate(prompt, SamplingParams(max_tokens=n, stop_at_eos=False)))
        stats = events[-1].spec
        rounds, plain = rounds + stats.rounds, plain + stats.plain_steps
        for i, (t, a) in enumerate(zip(stats.position_tried, stats.position_accepted)):
            tried[i] += t
            accepted[i] += a
    # positions past the first rejection are not judged in that round: acceptance given the earlier ones
    judged = [min(accepted[i - 1], tried[i]) if i > 0 else tried[0] for i in range(kmax)]
    a = [(accepted[i] + 0.5) / (judged[i] + 1) if judged[i] else 0.0 for i in range(kmax)]
    return a, rounds / (rounds + plain) if rounds + plain else 0.0


def measure(name: str, target, drafter, prompts: dict[str, list[int]], t_plain: float, v: dict[int, float],
            n: int) -> Candidate:
    """One candidate's r, acceptance and coverage, and the speed-up the model predicts for each k."""
    r = draft_cost(drafter, next(iter(prompts.values()))) / t_plain
    a, coverage = acceptance(target, drafter, prompts, len(v), n)
    predicted = predict(v, r, a, coverage)
    best_k = max(predicted, key=predicted.get)
    return Candidate(name, r, a, coverage, predicted, best_k, predicted[best_k])


def choose(target, candidates: list[Candidate], drafters: dict, prompts: dict[str, list[int]],
           v: dict[int, float], n: int) -> tuple[Candidate, float | None, list[dict]]:
    """The winner, its measured speed-up and the checks: the model narrows the field to its three best
    (candidate, k); a short interleaved run against plain decoding picks among them. Fills each loser's
    why_not; the winner is a Candidate named "none" when nothing is predicted faster than plain decoding."""
    from quickdraft import bench

    ranked = sorted(((c.predicted[k], c.name, k) for c in candidates for k in c.predicted), reverse=True)
    top = [(name, k) for predicted, name, k in ranked if predicted > 1][:3]
    if not top:
        best = max(candidates, key=lambda c: c.best_speedup)
        for c in candidates:
            c.why_not = "" if c is best else explain(c, v, best)
        return Candidate("none", 0.0, [], 0.0, {}, 0, 1.0, ""), None, []
    check = bench.run(target, {name: drafters[name] for name, _ in top},
                      [bench.BenchConfig("none")] + [bench.BenchConfig(name, k) for name, k in top],
                      dict(list(prompts.items())[:2]), n, runs=1)
    speedups = {s["config"]: s["speedup"] for s in check["summary"]}
    by_name = {c.name: c for c in candidates}
    checked = [{"candidate": name, "k": k, "predicted": by_name[name].predicted[k],
                "measured": speedups[bench.BenchConfig(name, k).name]} for name, k in top]
    best = max(checked, key=lambda x: x["measured"])
    winner = by_name[best["candidate"]]
    winner.best_k, winner.best_speedup = best["k"], best["predicted"]
    for c in candidates:
        c.why_not = "" if c is winner else explain(c, v, winner)
    return winner, best["measured"], checked


def predict(v: dict[int, float], r: float, a: list[float], coverage: float = 1.0) -> dict[int, float]:
    out, expected, run = {}, 1.0, 1.0
    for k in range(1, len(a) + 1):
        run *= a[k - 1]
        expected += run
        out[k] = (coverage * expected + 1 - coverage) / (coverage * (v[k] + k * r) + 1 - coverage)
    return out


def explain(c: Candidate, v: dict[int, float], winner: Candidate) -> str:
    """Why a candidate lost to the winner, in terms of the model's three factors."""
    k = c.best_k
    if c.best_speedup < 1:
        reasons = []
        if c.r > 0.3:
            reasons.append(f"too slow a draft (a drafted token costs {c.r:.2f} target steps)")
        if c.acceptance and c.acceptance[0] < 0.5:
            reasons.append(f"too low an acceptance ({100 * c.acceptance[0]:.0f}% at position 1)")
        if c.coverage < 0.5:
            reasons.append(f"too few proposals (a round on {100 * c.coverage:.0f}% of steps)")
        if v.get(k, 1) > 1.5:
            reasons.append(f"verification too costly (v({k}) = {v[k]:.2f})")
        return "slower than plain decoding: " + ("; ".join(reasons) or "the gains do not cover the costs")
    if c.r > winner.r * 1.5 and c.r > 0.1:
        return f"its drafted tokens cost more ({c.r:.2f} vs {winner.r:.2f} target steps)"
    if c.coverage < 0.8 * winner.coverage:
        return f"it proposes on fewer steps ({100 * c.coverage:.0f}% vs {100 * winner.coverage:.0f}%)"
    if c.acceptance and winner.acceptance and c.acceptance[0] < winner.acceptance[0]:
        return f"lower acceptance ({100 * c.acceptance[0]:.0f}% vs {100 * winner.acceptance[0]:.0f}% at position 1)"
    return f"predicted {c.best_speedup:.2f}x against {winner.best_speedup:.2f}x"


def write_profile(path: Path, target_name: str, winner: Candidate, measured: float | None, candidates, v,
                  checked: list[dict]) -> dict:
    draft, ngram = winner.name, False
    if draft.endswith("+ngram"):
        draft, ngram = draft[: -len("+ngram")], True
    profile = {"version": PROFILE_VERSION, "target": target_name, "draft": draft, "ngram": ngram,
               "draft_max": winner.best_k, "fixed_k": True, "predicted_speedup": winner.best_speedup,
               "measured_speedup": measured, "v": v, "candidates": [asdict(c) for c in candidates],
               "checked": checked}
    path.write_text(json.dumps(profile, indent=1))
    return profile


def read_profile(path: Path) -> dict:
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuickdraftError(f"{path}: no such profile; write one with `quickdraft tune --profile {path}`") from None
    except json.JSONDecodeError as e:
        raise QuickdraftError(f"{path} is not a quickdraft profile (not JSON: {e})") from None
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION or "draft" not in profile:
        raise QuickdraftError(f"{path} is not a quickdraft profile (version {PROFILE_VERSION}); run tune again")
    return profile
