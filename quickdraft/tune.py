"""`quickdraft tune`: measure each candidate draft, fit the speed model, predict the best draft and k,
check the prediction with a short run, and write a profile that `generate` and `serve` take.

The speed model (DESIGN.md): with t_plain one target step, v(k) = t_verify(k) / t_plain the cost of
verifying k drafts (k + 1 tokens), r = t_draft / t_plain the cost of one drafted token, and a_i the
acceptance of draft position i given the ones before were accepted, a round emits
E[L](k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens, so speculation runs at
speed-up(k) = E[L](k) / (v(k) + k r) times plain decoding.

Acceptance is not the same at every point of a text (a run of boilerplate, then a hard stretch), and a round
starts where the last one stopped, so a_i measured at one k mispredicts E[L] at another, and acceptance pooled
over prompts mispredicts each prompt's speed-up (the benchmark's figure is their median). For greedy decoding
neither guess is needed: tune decodes each prompt once without speculation, finds where each candidate's
drafts would agree with that output (one teacher-forced pass of the draft; n-gram lookup asked directly),
and replays the engine's rounds at every k over it: E[L](k), the share of steps with something to draft
(n-gram lookup needs a match) and the draft passes are counted, not modelled; only the costs v(k), r and
the engine's per-step work are measured timings.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quickdraft.config import SamplingParams, SpecConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.roofline import median_seconds
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


@torch.inference_mode()
def draft_cost(drafter, prompt: list[int], reps: int = 3) -> float:
    """Seconds per drafted token of a draft model (0 for n-gram lookup)."""
    draft = draft_model_of(drafter)
    if draft is None:
        return 0.0
    model = draft.model
    device = model.device
    cache = KVCache.for_model(model, len(prompt) + 2)
    model(torch.tensor([prompt], device=device), cache, last_only=True)
    feed = torch.tensor([prompt[-1:]], device=device)
    return median_seconds(lambda: model(feed, cache, last_only=True), device, reps,
                          lambda: cache.rollback(len(prompt)))


def reference(target, prompts: dict[str, list[int]], n: int) -> tuple[dict[str, list[int]], float]:
    """Each prompt's greedy output without speculation (what every candidate reproduces, so what its drafts
    are judged against) and the engine's median seconds per plain step: the target's pass plus the engine's
    own per-step work (sampling, bookkeeping), which a round pays once for all the tokens it emits."""
    engine = Engine(target, target.model.max_context, None, SpecConfig(draft_max=0))
    outputs, steps = {}, []
    for name, prompt in prompts.items():
        events = list(engine.generate(prompt, SamplingParams(max_tokens=n, stop_at_eos=False)))
        outputs[name] = [e.token for e in events if e.token is not None]
        t = events[-1].timings
        if t.n_decoded:
            steps.append(t.decode_s / t.n_decoded)
    return outputs, statistics.median(steps)


@dataclass
class Offer:
    """What a drafter would propose at one position of the reference output, drafting up to kmax."""
    source: str  # "draft" or "ngram"; "" when it has nothing to propose
    available: int  # how many tokens it would propose at most (a draft model stops early when unsure)
    kept: int  # how many of them the target keeps: the agreement with the reference output


@torch.inference_mode()
def offers(drafter, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
    """The drafter's offer at each decode position t = 1..len(output) - 1 (seq = prompt + output[:t]).

    Exact for greedy decoding without running rounds: a draft model's i-th guess, once the ones before it
    were kept, sees the reference prefix, so the target keeps the run of positions from t on where the draft's
    next-token choice on the reference sequence (one teacher-forced pass) is the reference token, and the draft
    stops early (p_min) at the first position after t where its top probability there is below p_min. (Past
    a wrong guess the draft sees its own token, not the reference's; its confidence there is taken from the
    reference sequence: that only moves the cost of drafts the target rejects anyway.) N-gram lookup is
    deterministic in the sequence: its proposal is asked for directly."""
    n = len(output)
    draft, ngram = draft_model_of(drafter), _ngram_of(drafter)
    agree, sure = [False] * n, [True] * n
    if draft is not None:
        seq = prompt + output
        cache = KVCache.for_model(draft.model, len(seq))
        logits = draft.model(torch.tensor([seq[:-1]], device=draft.device), cache)[0, len(prompt) - 1:]
        logits = logits[:, : draft.target_vocab]
        agree = [g == o for g, o in zip(logits.argmax(-1).tolist(), output)]
        if draft.p_min > 0:
            sure = (logits.softmax(-1).amax(-1) >= draft.p_min).tolist()
    if ngram is not None:
        ngram.begin(prompt)
    out = [Offer("", 0, 0)]  # t = 0: the first token comes from the prompt's pass
    for t in range(1, n):
        tokens = ngram.propose(prompt + output[:t], lambda s: kmax, None, None).tokens if ngram else []
        if tokens:
            kept = next((i for i, (a, b) in enumerate(zip(tokens, output[t:])) if a != b), min(len(tokens), n - t))
            out.append(Offer("ngram", len(tokens), kept))
        elif draft is not None:
            span = min(kmax, n - t)
            available = next((i for i in range(1, span) if not sure[t + i]), kmax)
            kept = next((i for i in range(span) if not agree[t + i]), span)
            out.append(Offer("draft", available, kept))
        else:
            out.append(Offer("", 0, 0))
    return out


def _ngram_of(drafter):
    from quickdraft.spec.combined import CombinedDrafter
    from quickdraft.spec.ngram import NgramDrafter

    if isinstance(drafter, CombinedDrafter):
        return drafter.ngram
    return drafter if isinstance(drafter, NgramDrafter) else None


@dataclass
class Costs:
    """Seconds: the target's pass over one token, and over k + 1 (v(k) of it); the engine's per-step work;
    one drafted token."""
    t_plain: float
    v: dict[int, float]
    overhead: float
    t_draft: float

    def step(self) -> float:
        return self.t_plain + self.overhead

    def verify(self, k: int) -> float:
        return self.v[k] * self.t_plain + self.overhead


def simulate(offers_: list[Offer], k: int, costs: Costs) -> dict:
    """The engine's rounds at fixed k over the reference output, and their time under the costs.

    At position t a round drafts min(k, offered, tokens left - 1), the target keeps min(that, agreement), and
    emits one more; with nothing to draft it is a plain step. A draft model runs one pass per drafted token,
    one more when it stopped early (the pass that found it unsure), and one catch-up pass when more than two
    tokens arrived since it last drafted (after plain steps or n-gram rounds)."""
    n = len(offers_)
    t, seconds, lag = 1, 0.0, 1
    rounds = plain = 0
    tried, kept_at = [0] * k, [0] * k
    while t < n:
        o = offers_[t]
        limit = min(k, n - t - 1)
        drafted = min(limit, o.available)
        if drafted <= 0:
            seconds += costs.step()
            plain, t, lag = plain + 1, t + 1, lag + 1
            continue
        kept = min(drafted, o.kept)
        seconds += costs.verify(drafted)
        if o.source == "draft":
            seconds += (drafted + (drafted < limit) + (lag > 2)) * costs.t_draft
            lag = 2 if kept == drafted else 1
        else:
            lag += kept + 1
        rounds += 1
        for i in range(drafted):
            tried[i] += 1
            kept_at[i] += i < kept
        t += kept + 1
    return {"seconds": seconds, "rounds": rounds, "plain": plain, "tried": tried, "kept": kept_at,
            "speedup": (n - 1) * costs.step() / seconds if seconds else 1.0}


def measure(name: str, drafter, prompts: dict[str, list[int]], outputs: dict[str, list[int]], t_plain: float,
            t_step: float, v: dict[int, float]) -> Candidate:
    """One candidate: r, its offers on every prompt's reference output, and the speed-up predicted for each k
    (the median over prompts of each prompt's predicted speed-up, as the benchmark summarises)."""
    kmax = len(v)
    r = draft_cost(drafter, next(iter(prompts.values()))) / t_plain
    costs = Costs(t_plain, v, max(t_step - t_plain, 0.0), r * t_plain)
    per_prompt = {p: offers(drafter, prompts[p], outputs[p], kmax) for p in prompts}
    predicted = {k: statistics.median(simulate(o, k, costs)["speedup"] for o in per_prompt.values())
                 for k in range(1, kmax + 1)}
    tried, kept, rounds, steps = [0] * kmax, [0] * kmax, 0, 0
    for o in per_prompt.values():
        sim = simulate(o, kmax, costs)
        tried = [a + b for a, b in zip(tried, sim["tried"])]
        kept = [a + b for a, b in zip(kept, sim["kept"])]
        rounds, steps = rounds + sim["rounds"], steps + sim["rounds"] + sim["plain"]
    # acceptance of position i given the ones before it were kept (positions past a rejection are not judged)
    judged = [tried[0]] + [min(kept[i - 1], tried[i]) for i in range(1, kmax)]
    a = [(kept[i] + 0.5) / (judged[i] + 1) if judged[i] else 0.0 for i in range(kmax)]
    best_k = max(predicted, key=predicted.get)
    return Candidate(name, r, a, rounds / steps if steps else 0.0, predicted, best_k, predicted[best_k])


SWITCH = 1.10  # a checked alternative replaces the model's pick only when measured this much faster


def choose(target, candidates: list[Candidate], drafters: dict, prompts: dict[str, list[int]],
           v: dict[int, float], n: int) -> tuple[Candidate, float | None, list[dict]]:
    """The winner, its measured speed-up and the checks. The model picks; a short interleaved run against
    plain decoding measures its pick and each other candidate (at its best k) predicted within 15% of it. A
    short run is noisy, so an alternative replaces the pick only when measured more than 10% faster: then the
    model was wrong, not the clock. Fills each loser's why_not; the winner is a Candidate named "none" when
    nothing is predicted faster than plain decoding."""
    from quickdraft import bench

    ranked = sorted((c for c in candidates if c.best_speedup > 1), key=lambda c: c.best_speedup, reverse=True)
    if not ranked:
        best = max(candidates, key=lambda c: c.best_speedup)
        for c in candidates:
            c.why_not = "" if c is best else explain(c, v, best)
        return Candidate("none", 0.0, [], 0.0, {}, 0, 1.0, ""), None, []
    top = [c for c in ranked if c.best_speedup >= 0.85 * ranked[0].best_speedup][:3]
    check = bench.run(target, {c.name: drafters[c.name] for c in top},
                      [bench.BenchConfig("none")] + [bench.BenchConfig(c.name, c.best_k) for c in top],
                      dict(list(prompts.items())[:2]), n, runs=1)
    speedups = {s["config"]: s["speedup"] for s in check["summary"]}
    checked = [{"candidate": c.name, "k": c.best_k, "predicted": c.best_speedup,
                "measured": speedups[bench.BenchConfig(c.name, c.best_k).name]} for c in top]
    pick = checked[0]
    fastest = max(checked, key=lambda x: x["measured"])
    if fastest["measured"] > SWITCH * pick["measured"]:
        pick = fastest
    winner = next(c for c in top if c.name == pick["candidate"])
    for c in candidates:
        c.why_not = "" if c is winner else explain(c, v, winner)
    return winner, pick["measured"], checked


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
                  checked: list[dict], p_min: float) -> dict:
    draft, ngram = winner.name, False
    if draft.endswith("+ngram"):
        draft, ngram = draft[: -len("+ngram")], True
    profile = {"version": PROFILE_VERSION, "target": target_name, "draft": draft, "ngram": ngram,
               "draft_max": winner.best_k, "fixed_k": True, "p_min": p_min, "predicted_speedup": winner.best_speedup,
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
