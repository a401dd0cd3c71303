"""`quickdraft tune`: measure each candidate draft, fit the speed model, predict the best draft and k, check the
prediction with a short run, and write a profile that `generate` and `serve` take.

The speed model is speculative/speed.py's: a round of k drafts emits E[L](k) tokens at the cost of v(k) + k r
target steps. Acceptance is not the same at every point of a text (a run of boilerplate, then a hard stretch),
and a round starts where the last one stopped, so a_i measured at one k mispredicts E[L] at another, and
acceptance pooled over prompts mispredicts each prompt's speed-up (the benchmark's figure is their median). For
greedy decoding neither guess is needed: tune decodes each prompt once without speculation, asks each candidate
what it would propose at every position of that output (Drafter.offers), and replays the engine's rounds at every
k over it, with the drafter's own rule for what a round costs it (Drafter.replay_round) and the engine's budget
(engine.draft_budget): E[L](k), the share of steps with something to draft (n-gram lookup needs a match) and the
draft passes are counted, not modelled; only the costs v(k), r and the engine's per-step work are timings.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from quickdraft.config import MAX_DRAFT, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine, draft_budget
from quickdraft.errors import QuickdraftError
from quickdraft.speculative.base import Offer
from quickdraft.speculative.draft import Draft

PROFILE_VERSION = 2


@dataclass
class Candidate:
    name: str  # the draft as users write it: a draft model, "ngram", or "ngram+MODEL"
    r: float  # drafted token cost / target step
    acceptance: list[float]  # a_1..a_kmax, conditional per position
    coverage: float = 1.0  # share of steps on which the drafter proposed something
    predicted: dict[int, float] = field(default_factory=dict)  # k -> speed-up
    best_k: int = 0
    best_speedup: float = 0.0
    why_not: str = ""
    vocab: int = 0  # the draft model's --draft-vocab (0: its whole head)
    tree: int = 1  # tree verification's candidates at the chain's least sure position (--draft-tree; 1: a chain)
    alternatives: float = 0.0  # a tree: share of its rounds (at best_k) that kept an alternative


def reference(target, prompts: dict[str, list[int]], n: int) -> tuple[dict[str, list[int]], float]:
    """Each prompt's greedy output without speculation (what every candidate reproduces, so what its drafts
    are judged against) and the engine's median seconds per plain step: the target's pass plus the engine's
    own per-step work (sampling, bookkeeping), which a round pays once for all the tokens it emits."""
    engine = Engine(target, target.model.max_context, None, SpeculationConfig(draft_max=0))
    outputs, steps = {}, []
    for name, prompt in prompts.items():
        events = list(engine.generate(prompt, SamplingParams(max_tokens=n, stop_at_eos=False)))
        outputs[name] = [e.token for e in events if e.token is not None]
        t = events[-1].timings
        if t.n_decoded:
            steps.append(t.decode_s / t.n_decoded)
    return outputs, statistics.median(steps)


@dataclass
class Costs:
    """Seconds: the target's pass over one token, and over k + 1 (v(k) of it); the engine's per-step work;
    one pass of the drafter; a tree's pass, per width (roofline.v_tree: k drafts and width - 1 candidates)."""
    t_plain: float
    v: dict[int, float]
    overhead: float
    t_draft: float
    v_tree: dict[int, dict[int, float]] = field(default_factory=dict)

    def step(self) -> float:
        return self.t_plain + self.overhead

    def verify(self, k: int, width: int = 1) -> float:
        v = self.v[k] if width < 2 else self.v_tree[width][k]
        return v * self.t_plain + self.overhead


def simulate(offers_: list[Offer], k: int, costs: Costs, replay_round, width: int = 1) -> dict:
    """The engine's rounds at fixed k over the known output, and their time under the costs.

    At position t a round drafts what the engine's budget allows of the offer, the target keeps min(that,
    agreement) and emits one more; with nothing to draft it is a plain step. replay_round (Drafter.replay_round)
    says how many drafter passes each round costs, as the drafter would run it. width > 1: tree verification
    (--draft-tree): a round whose offer can be a tree (its confidence known) verifies width - 1 candidates beside
    the chain, and one more token is kept where the known token is among them (Offer.tree_keeps)."""
    n = len(offers_)
    t, seconds, behind = 1, 0.0, 1
    rounds = plain = trees = alternatives = 0
    tried, kept_at = [0] * k, [0] * k
    while t < n:
        o = offers_[t]
        limit = min(k, draft_budget(n, t, n))
        drafted = min(limit, o.available)
        if drafted <= 0:
            seconds += costs.step()
            _, behind = replay_round("", 0, False, 0, behind)
            plain, t = plain + 1, t + 1
            continue
        kept = min(drafted, o.kept)
        passes, behind = replay_round(o.source, drafted, drafted < limit, kept, behind)
        tree = width if width > 1 and len(o.confidence) >= drafted else 1
        extra = o.tree_keeps(drafted, tree)
        seconds += costs.verify(drafted, tree) + passes * costs.t_draft
        rounds, trees, alternatives = rounds + 1, trees + (tree > 1), alternatives + extra
        for i in range(drafted):
            tried[i] += 1
            kept_at[i] += i < kept
        t += kept + 1 + extra
        behind += extra  # the candidate it did not draft
    return {"seconds": seconds, "rounds": rounds, "plain": plain, "tried": tried, "kept": kept_at, "trees": trees,
            "alternatives": alternatives, "speedup": (n - 1) * costs.step() / seconds if seconds else 1.0}


def measure(name: str, drafter, prompts: dict[str, list[int]], outputs: dict[str, list[int]], t_plain: float,
            t_step: float, v: dict[int, float], v_tree: dict[int, dict[int, float]] | None = None) -> list[Candidate]:
    """One candidate: r, its offers on every prompt's known output, and the speed-up predicted for each k
    (the median over prompts of each prompt's predicted speed-up, as the benchmark summarises). With v_tree (a
    drafter offering trees, on a target that verifies them), the same drafter as a tree of each width measured there
    too, from the same offers: one Candidate per width after the chain's."""
    kmax = len(v)
    r = drafter.pass_seconds(next(iter(prompts.values()))) / t_plain
    widths = sorted(v_tree or {}) if drafter.trees else []
    costs = Costs(t_plain, v, max(t_step - t_plain, 0.0), r * t_plain, v_tree or {})
    per_prompt = {p: drafter.offers(prompts[p], outputs[p], kmax) for p in prompts}
    replay = drafter.replay_round
    tried, kept, rounds, steps = [0] * kmax, [0] * kmax, 0, 0
    for o in per_prompt.values():
        sim = simulate(o, kmax, costs, replay)
        tried = [a + b for a, b in zip(tried, sim["tried"])]
        kept = [a + b for a, b in zip(kept, sim["kept"])]
        rounds, steps = rounds + sim["rounds"], steps + sim["rounds"] + sim["plain"]
    # acceptance of position i given the ones before it were kept (positions past a rejection are not judged)
    judged = [tried[0]] + [min(kept[i - 1], tried[i]) for i in range(1, kmax)]
    a = [(kept[i] + 0.5) / (judged[i] + 1) if judged[i] else 0.0 for i in range(kmax)]
    out = []
    for width in [1] + widths:
        sims = {k: [simulate(o, k, costs, replay, width) for o in per_prompt.values()]
                for k in range(1, kmax + 1) if width < 2 or k in costs.v_tree[width]}
        if not sims:
            continue
        predicted = {k: statistics.median(x["speedup"] for x in runs) for k, runs in sims.items()}
        best_k = max(predicted, key=predicted.get)
        alternatives = sum(x["alternatives"] for x in sims[best_k]) / max(sum(x["trees"] for x in sims[best_k]), 1)
        out.append(Candidate(name, r, a, rounds / steps if steps else 0.0, predicted, best_k, predicted[best_k],
                             tree=width, alternatives=alternatives))
    return out


SWITCH = 1.10  # a checked alternative replaces the model's pick only when measured this much faster


def choose(llm, candidates: list[Candidate], prompts: dict[str, list[int]], v: dict[int, float],
           n: int, drafts: dict[str, Draft] | None = None) -> tuple[Candidate, float | None, list[dict]]:
    """The winner, its measured speed-up and the checks. The model picks; a short interleaved run against
    plain decoding measures its pick and each other candidate (at its best k) predicted within 15% of it. A
    short run is noisy, so an alternative replaces the pick only when measured more than 10% faster: then the
    model was wrong, not the clock. Fills each loser's why_not; the winner is a Candidate named "none" when
    nothing is predicted faster than plain decoding. drafts: the Drafts measured, by name (their weight format and
    device, which a name does not carry)."""
    from quickdraft.tools import bench

    ranked = sorted((c for c in candidates if c.best_speedup > 1), key=lambda c: c.best_speedup, reverse=True)
    if not ranked:
        best = max(candidates, key=lambda c: c.best_speedup)
        for c in candidates:
            c.why_not = "" if c is best else explain(c, v, best)
        return Candidate("none", 0.0, [], 0.0, {}, 0, 1.0, ""), None, []
    top = [c for c in ranked if c.best_speedup >= 0.85 * ranked[0].best_speedup][:3]
    drafts = drafts or {}
    configs = [bench.BenchConfig(c.name, drafts.get(c.name) or Draft.parse(c.name), c.best_k, c.vocab or None, c.tree)
               for c in top]
    check = bench.run(llm, [bench.PLAIN] + configs, dict(list(prompts.items())[:2]), n, runs=1)
    by_config = {s["config"]: s for s in check["summary"]}
    checked = [{"candidate": c.name, "vocab": c.vocab, "tree": c.tree, "k": c.best_k, "predicted": c.best_speedup,
                "measured": by_config[config.name]["speedup"], "tok_s": by_config[config.name]["decode_tok_s"],
                "plain_tok_s": by_config[bench.PLAIN.name]["decode_tok_s"]}
               for c, config in zip(top, configs)]
    pick = checked[0]
    fastest = max(checked, key=lambda x: x["measured"])
    if fastest["measured"] > SWITCH * pick["measured"]:
        pick = fastest
    winner = next(c for c in top if (c.name, c.vocab, c.tree) == (pick["candidate"], pick["vocab"], pick["tree"]))
    for c in candidates:
        c.why_not = "" if c is winner else explain(c, v, winner)
    return winner, pick["measured"], checked


SUBSET = 32768  # the --draft-vocab tune also measures each draft model with (speculative/subset.py)
TREE = 3  # the widest tree (--draft-tree) tune also measures each drafter offering trees as


def run(llm, candidates: list[Draft], prompts: dict[str, list[int]], kmax: int, p_min: float, n: int,
        log=lambda message: print(f"tune: {message}", file=sys.stderr), vocab: int = SUBSET, tree: int = TREE) -> dict:
    """Measure every candidate draft for llm's target and choose; returns the profile (write_profile keeps it).
    vocab: also measure each draft model with its head cut to that many ids (0: not); tree: also measure each
    drafter that offers trees as trees of 2..tree candidates, where the target verifies trees (1: chains alone)."""
    from quickdraft.tools import roofline

    if not 1 <= kmax <= MAX_DRAFT:
        raise QuickdraftError(f"--kmax must be in 1..{MAX_DRAFT}")
    target = llm.target
    log(f"decoding the {len(prompts)} prompts without speculation")
    outputs, t_step = reference(target, prompts, n)
    name, first = next(iter(prompts.items()))
    # verification is timed mid-generation: attention over the prompt and half the output
    log(f"measuring the target's verification cost v(k), k = 1..{kmax}")
    t_plain, v = roofline.v_curve(target, first + outputs[name][: n // 2], kmax)
    if max(v) < kmax:  # a hybrid's recurrent state rolls back at most max(v) positions: no round drafts more
        log(f"k is at most {max(v)} for this target (its recurrent state keeps that many positions)")
        kmax = max(v)
    speculation = SpeculationConfig(draft_max=kmax, p_min=p_min)
    v_tree = None
    if tree > 1 and target.trees:
        log(f"measuring the target's tree verification cost, 2..{tree} candidates beside k = 1..{kmax}")
        v_tree = roofline.v_tree(target, first + outputs[name][: n // 2], kmax, list(range(2, tree + 1)))
    elif tree > 1:
        log("trees: not measured (tree verification runs on the CPU)")
    results = []
    for draft in candidates:
        for cut in ([0, vocab] if vocab and getattr(draft.drafter_class, "text_model", False) else [0]):
            try:
                drafter = llm.drafter(draft, replace(speculation, draft_vocab=cut))
            except QuickdraftError as e:
                if not cut:
                    raise
                log(f"{draft} with --draft-vocab {cut}: not measured ({e})")
                continue
            if cut and not drafter.cut_head:  # a vocabulary of at most `cut` ids: nothing to cut
                continue
            log(f"measuring {draft}" + (f" with --draft-vocab {cut}" if cut else ""))
            results += [replace(c, vocab=cut) for c in measure(str(draft), drafter, prompts, outputs, t_plain,
                                                                t_step, v, v_tree)]
    log("checking the best predictions against plain decoding")
    winner, measured, checked = choose(llm, results, prompts, v, n, {str(d): d for d in candidates})
    pick = next((x for x in checked if (x["candidate"], x["vocab"], x["tree"]) == (winner.name, winner.vocab,
                                                                                      winner.tree)), None)
    plain_tok_s = pick["plain_tok_s"] if pick else 1 / t_step  # decode tok/s without and with the pick, same run
    parsed = Draft.parse(winner.name) if winner.name != "none" else None
    kind = parsed.kind if parsed is not None else "none"
    parts = list(parsed.parts) if kind == "chain" else [Draft("ngram"), parsed] if parsed is not None and \
        parsed.ngram else [parsed] if parsed is not None else []
    return {"version": PROFILE_VERSION, "target": target.name, "weights": target.weights, "draft": winner.name,
            "draft_kind": _flavour(parsed) if parsed is not None and kind != "chain" else kind,
            "draft_kinds": [_flavour(p) for p in parts],
            "draft_max": winner.best_k, "draft_vocab": winner.vocab, "draft_tree": winner.tree, "fixed_k": True,
            "p_min": p_min,
            "predicted_speedup": winner.best_speedup, "measured_speedup": measured, "plain_tok_s": plain_tok_s,
            "tok_s": pick["tok_s"] if pick else plain_tok_s,
            "t_plain_s": t_plain, "t_step_s": t_step, "v": v, **({"v_tree": v_tree} if v_tree else {}),
            "candidates": [asdict(c) for c in results],
            "checked": checked}


# Perplexity on quality.TEXT above bf16's, in percent, that a recommended format may have unless the user allows
# more: the default formats keep a GGUF file's quality (mixed: +0.6% on the default target), int4 does not (+2.5%).
QUALITY_BOUND = 1.5


def by_format(load, formats: list[str], candidates, prompts: dict[str, list[int]], kmax: int, p_min: float, n: int,
              bound: float = QUALITY_BOUND, log=lambda message: print(f"tune: {message}", file=sys.stderr),
              vocab: int = SUBSET, tree: int = TREE) -> dict:
    """tune (run) the pair in each target weight format of `formats` and recommend the fastest whose perplexity
    on quality.TEXT is within `bound` percent of bf16's (the most faithful one when none is). load(fmt): the LLM
    with its target in that format; candidates(llm): its candidate Drafts. Returns the recommended format's
    profile, with every format's quality and measured speeds under "formats"."""
    import gc

    from quickdraft.tools import quality

    log("scoring the quality text with bf16 weights (the reference)")
    llm = load("bf16")
    tokens = quality.text_tokens(llm.target.tokenizer)
    reference = quality.log_probs(llm.target.model, tokens)
    rows, profiles = [], []
    for fmt in formats:
        if fmt != "bf16" or llm is None:
            llm = None
            gc.collect()
            llm = load(fmt)
        log(f"target in {llm.target.weights}: scoring the quality text")
        if llm.target.weights == "bf16":
            ppl = quality.perplexity_of(reference, tokens)
            q = quality.Quality(ppl, ppl, 0.0, 1.0, len(tokens))
        else:
            q = quality.compare(llm.target.model, tokens, reference)
        profile = run(llm, candidates(llm), prompts, kmax, p_min, n, log, vocab, tree)
        rows.append({"weights": llm.target.weights, **q.as_dict(), "plain_tok_s": profile["plain_tok_s"],
                     "tok_s": profile["tok_s"], "draft": profile["draft"], "draft_max": profile["draft_max"],
                     "draft_vocab": profile["draft_vocab"], "draft_tree": profile["draft_tree"],
                     "within_bound": q.ppl_increase <= bound})
        profiles.append(profile)
        llm = None
    within = [i for i, r in enumerate(rows) if r["within_bound"]]
    best = (max(within, key=lambda i: rows[i]["tok_s"]) if within
            else min(range(len(rows)), key=lambda i: rows[i]["kl"]))
    return {**profiles[best], "quality_bound": bound, "formats": rows}


def report(profile: dict) -> str:
    """The profile as the tune command prints it."""
    fmt = f" (target in {profile['weights']})" if "formats" in profile else ""
    lines = [f"target step{fmt} {1000 * profile['t_plain_s']:.0f} ms; v(k): "
             + ", ".join(f"{k}: {x:.2f}" for k, x in profile["v"].items()),
             f"{'candidate':{LABEL}} {'r':>5} {'a1':>5} {'rounds':>6} {'best k':>6} {'predicted':>9}"]
    if profile.get("v_tree"):
        lines.insert(1, "tree passes (k drafts and B - 1 candidates), over a one-token pass: " + "; ".join(
            f"B={w}: " + ", ".join(f"{k}: {x:.2f}" for k, x in list(curve.items())[:8])
            for w, curve in profile["v_tree"].items()))
    for c in profile["candidates"]:
        label = _label(c)
        lines.append(f"{label:{LABEL}} {c['r']:5.2f} {100 * c['acceptance'][0]:4.0f}% {100 * c['coverage']:5.0f}% "
                     f"{c['best_k']:6} {c['best_speedup']:8.2f}x  {c['why_not']}")
    for x in profile["checked"]:
        lines.append(f"checked {_label({**x, 'name': x['candidate']})} k={x['k']}: predicted {x['predicted']:.2f}x, "
                     f"measured {x['measured']:.2f}x")
    if "formats" in profile:
        lines += _formats_report(profile)
    if profile["draft"] == "none":
        lines.append("recommendation: no speculation; every candidate is predicted slower than plain decoding")
    else:
        flags = ([f"--draft-vocab {profile['draft_vocab']}"] if profile.get("draft_vocab") else []) + (
            [f"--draft-tree {profile['draft_tree']}"] if profile.get("draft_tree", 1) > 1 else [])
        vocab = f" with {' '.join(flags)}" if flags else ""
        lines.append(f"recommendation: {profile['draft']}{vocab} at k = {profile['draft_max']}: predicted "
                     f"{profile['predicted_speedup']:.2f}x, measured {profile['measured_speedup']:.2f}x on a short run")
    return "\n".join(lines)


LABEL = 44  # the candidates' column: a draft model's name with its cut head and tree


def _label(c: dict) -> str:
    """A candidate as the report names it: the draft, its cut head and its tree."""
    return c["name"] + (f" vocab={c['vocab']}" if c.get("vocab") else "") + (
        f" tree={c['tree']}" if c.get("tree", 1) > 1 else "")


def _formats_report(profile: dict) -> list[str]:
    bound = profile["quality_bound"]
    lines = [f"target formats (quality: {profile['formats'][0]['tokens']} positions of the quality text against "
             "bf16; decode tok/s plain and with the format's own pick, from its check run):",
             f"{'weights':7} {'ppl':>8} {'vs bf16':>8} {'KL':>7} {'top-1':>6} {'plain':>7} {'pair':>7}  pair's draft"]
    for r in profile["formats"]:
        mark = "" if r["within_bound"] else f"  over the {bound:g}% bound"
        lines.append(f"{r['weights']:7} {r['ppl']:8.3f} {r['ppl_increase']:+7.2f}% {r['kl']:7.4f} "
                     f"{100 * r['top1']:5.1f}% {r['plain_tok_s']:7.1f} {r['tok_s']:7.1f}  {r['draft']} k={r['draft_max']}"
                     + (f" vocab={r['draft_vocab']}" if r.get("draft_vocab") else "")
                     + (f" tree={r['draft_tree']}" if r.get("draft_tree", 1) > 1 else "") + mark)
    within = [r for r in profile["formats"] if r["within_bound"]]
    lines.append(f"weights: {profile['weights']}, " + (
        f"the fastest pair within {bound:g}% of bf16's perplexity" if within else
        f"no format is within {bound:g}% of bf16's perplexity: the closest to bf16 (raise --quality-bound to allow "
        "more)"))
    return lines


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
        if c.tree > 1:
            reasons.append(f"its tree kept an alternative in {100 * c.alternatives:.0f}% of rounds, not enough for "
                           "the candidates' rows")
        elif v.get(k, 1) > 1.5:
            reasons.append(f"verification too costly (v({k}) = {v[k]:.2f})")
        return "slower than plain decoding: " + ("; ".join(reasons) or "the gains do not cover the costs")
    if c.tree > 1 and winner.tree == 1 and (c.name, c.vocab) == (winner.name, winner.vocab):
        return (f"its tree kept an alternative in {100 * c.alternatives:.0f}% of rounds, which does not pay for the "
                f"candidates' rows: predicted {c.best_speedup:.2f}x against the chain's {winner.best_speedup:.2f}x")
    if winner.tree > 1 and c.tree == 1 and (c.name, c.vocab) == (winner.name, winner.vocab):
        return (f"the same drafter as a tree of {winner.tree} keeps an alternative in {100 * winner.alternatives:.0f}% "
                f"of rounds: predicted {winner.best_speedup:.2f}x against the chain's {c.best_speedup:.2f}x")
    if c.r > winner.r * 1.5 and c.r > 0.1:
        return f"its drafted tokens cost more ({c.r:.2f} vs {winner.r:.2f} target steps)"
    if c.coverage < 0.8 * winner.coverage:
        return f"it proposes on fewer steps ({100 * c.coverage:.0f}% vs {100 * winner.coverage:.0f}%)"
    if c.acceptance and winner.acceptance and c.acceptance[0] < winner.acceptance[0]:
        return f"lower acceptance ({100 * c.acceptance[0]:.0f}% vs {100 * winner.acceptance[0]:.0f}% at position 1)"
    return f"predicted {c.best_speedup:.2f}x against {winner.best_speedup:.2f}x"


def _flavour(draft: Draft) -> str:
    """The draft's kind as other engines name its method: a DFlash-kind directory holding a DSpark drafter is
    "dspark"."""
    return draft.drafter_class.flavour(draft)


def write_profile(path: Path, profile: dict) -> None:
    path.write_text(json.dumps(profile, indent=1))


def read_profile(path: Path) -> dict:
    """A profile tune wrote (its draft in the one spelling: version 1 kept n-gram lookup in a field of its own)."""
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuickdraftError(f"{path}: no such profile; write one with `quickdraft tune --profile {path}`") from None
    except json.JSONDecodeError as e:
        raise QuickdraftError(f"{path} is not a quickdraft profile (not JSON: {e})") from None
    if not isinstance(profile, dict) or profile.get("version") not in (1, PROFILE_VERSION) or "draft" not in profile:
        raise QuickdraftError(f"{path} is not a quickdraft profile (version {PROFILE_VERSION}); run tune again")
    if profile["version"] == 1 and profile.pop("ngram", False) and profile["draft"] not in ("none", "ngram"):
        profile["draft"] = f"ngram+{profile['draft']}"
    return profile
