"""`quickdraft bench`: an honest benchmark with a fixed method.

The bundled prompts (quickdraft.tools.prompts), a fixed number of generated tokens (greedy, end-of-generation
ignored so every run decodes the same length), warm-up runs first, then several measured runs with the
configurations interleaved (drift on a shared machine hits them all alike). Decode tok/s is measured from
the first token on (steady state), end-to-end tok/s separately (prefill included); medians with min and
max. Each configuration's figures include the speed model (speculative/speed.py): v(k), r and acceptance per
position as measured, and the speed-up they predict, beside the speed-up measured against plain decoding.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from quickdraft.config import MAX_DRAFT, SamplingParams, SpeculationConfig
from quickdraft.errors import QuickdraftError
from quickdraft.speculative import speed
from quickdraft.speculative.draft import NONE, Draft

SOURCES = ("draft", "ngram", "ngram+draft")
DEFAULT_CONFIGS = "plain,draft:k=2,draft:k=4,draft:k=8,draft:adaptive,ngram:adaptive,ngram+draft:adaptive"


@dataclass(frozen=True)
class BenchConfig:
    source: str  # the row's label: none (plain), draft, ngram, ngram+draft, or a tune candidate's name
    draft: Draft = NONE
    k: int | None = None  # None: the adaptive policy (up to draft_max)
    vocab: int | None = None  # the draft model's --draft-vocab (None: the run's)
    tree: int | None = None  # --draft-tree (None: the run's)

    @property
    def name(self) -> str:
        if self.draft.kind == "none":
            return "plain"
        vocab = "" if self.vocab is None else f" vocab={self.vocab}"
        tree = "" if self.tree is None or self.tree < 2 else f" tree={self.tree}"
        return f"{self.source} {'adaptive' if self.k is None else f'k={self.k}'}{vocab}{tree}"


PLAIN = BenchConfig("none")


def source_draft(source: str, draft: Draft) -> Draft | None:
    """What a configuration's source drafts with, given --draft: `draft` is that drafter alone, `ngram` prompt
    lookup, `ngram+draft` the drafter behind lookup; None where --draft has no drafter for it."""
    if source == "ngram":
        return Draft("ngram")
    if draft.kind in ("none", "ngram"):
        return None
    return replace(draft, ngram=source == "ngram+draft")


def parse_configs(text: str, draft: Draft = NONE) -> list[BenchConfig]:
    """'plain,draft:k=4,ngram+draft:adaptive:vocab=32768,draft:k=4:tree=3' -> configurations (QuickdraftError naming
    a bad item)."""
    configs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item == "plain":
            configs.append(PLAIN)
            continue
        source, _, how = item.partition(":")
        how, *options = how.split(":")
        named = dict(o.partition("=")[::2] for o in options)
        if source not in SOURCES or not (how == "adaptive" or (how.startswith("k=") and how[2:].isdigit()
                                                                and 1 <= int(how[2:]) <= MAX_DRAFT)) \
                or len(named) != len(options) or not set(named) <= {"vocab", "tree"} \
                or not all(x.isdigit() for x in named.values()) or ("vocab" in named and source == "ngram") \
                or int(named.get("tree", 1)) < 1:
            raise QuickdraftError(f"bad configuration {item!r}: use plain, or SOURCE:k=N (1..{MAX_DRAFT}) or SOURCE:adaptive "
                                  f"with SOURCE one of {', '.join(SOURCES)}, then :vocab=N for a draft model's "
                                  "--draft-vocab and :tree=B for --draft-tree")
        drafted = source_draft(source, draft)
        if drafted is None:
            raise QuickdraftError(f"configuration {item!r} needs a draft: give --draft")
        configs.append(BenchConfig(source, drafted, None if how == "adaptive" else int(how[2:]),
                                   int(named["vocab"]) if "vocab" in named else None,
                                   int(named["tree"]) if "tree" in named else None))
    if not configs:
        raise QuickdraftError("no configuration to benchmark: give --configs, e.g. plain,draft:adaptive")
    return configs


def default_configs(draft: Draft) -> str:
    """Plain and every configuration the draft allows."""
    if draft.kind == "ngram":
        return "plain,ngram:adaptive"
    return "plain" if draft.kind == "none" else DEFAULT_CONFIGS


def _speculation(config: BenchConfig, base: SpeculationConfig) -> SpeculationConfig:
    if not getattr(config.draft.drafter_class, "text_model", False):  # only a draft model has a head to cut
        base = replace(base, draft_vocab=0)
    elif config.vocab is not None:
        base = replace(base, draft_vocab=config.vocab)
    if config.tree is not None:
        base = replace(base, tree=config.tree)
    if config.draft.kind == "none":
        return replace(base, draft_max=0, draft_min=0)
    if config.k is None:
        return replace(base, adaptive=True)
    return replace(base, draft_max=config.k, draft_min=0, adaptive=False)  # up to k (a draft model's p_min applies)


def run(llm, configs: list[BenchConfig], prompts: dict[str, list[int]], n: int, runs: int, warmup: int = 1,
        speculation: SpeculationConfig = SpeculationConfig(), progress=None) -> dict:
    """Every configuration on every prompt, each on an engine of its own over llm's target; speculation: the
    settings every configuration starts from (adaptive ones draft up to its draft_max)."""
    engines = {c: llm.engine_for(c.draft, _speculation(c, speculation)) for c in configs}
    params = SamplingParams(max_tokens=n, stop_at_eos=False)
    rows = []
    for pname, prompt in prompts.items():
        for c in configs:
            for _ in range(warmup):
                list(engines[c].generate(prompt, SamplingParams(max_tokens=min(n, 16), stop_at_eos=False)))
        measured = {c: [] for c in configs}
        for _ in range(runs):
            for c in configs:  # every run from an empty cache: its time to first token is a cold prefill's
                events = list(engines[c].generate(prompt, params, reuse=False))
                measured[c].append(([e.token for e in events if e.token is not None], events[-1]))
                if progress:
                    progress(1)
        plain_tokens = next((m[0][0] for c, m in measured.items() if c.draft.kind == "none"), None)
        for c in configs:
            rows.append(_row(pname, c, measured[c], plain_tokens, engines[c]))
    _speedups(rows)
    graphs = llm.target.graphs  # a measurement on CUDA assumes them: say so if a capture turned them off
    return {"n": n, "runs": runs, "warmup": warmup, "prompts": list(prompts), "configs": [c.name for c in configs],
            "rows": rows, "summary": _summary(rows, configs),
            "graphs_off": graphs.disabled if graphs is not None else None}


def concurrent(llm, configs: list[BenchConfig], prompts: dict[str, list[int]], n: int, concurrency: int, runs: int,
               speculation: SpeculationConfig = SpeculationConfig(), progress=None) -> dict:
    """Each configuration with `concurrency` streams at once (engine.Batch: the prompts in a cycle, each stream a
    different one, every run from empty caches), beside the same streams one after another on the same engine (the
    reference): aggregate tok/s of both, each stream's own decode tok/s and TTFT, and whether every stream's tokens
    were those it got alone."""
    from quickdraft.engine import Batch

    texts = list(prompts.values())
    params = SamplingParams(max_tokens=n, stop_at_eos=False)
    rows = []
    for c in configs:
        engine = llm.engine_for(c.draft, _speculation(c, speculation))
        engine.slots.count = max(engine.slots.count, concurrency)
        list(engine.generate(texts[0], SamplingParams(max_tokens=min(n, 16), stop_at_eos=False)))  # warm-up
        requests = [dict(prompt=texts[i % len(texts)], params=params, reuse=False) for i in range(concurrency)]
        alone, together, same = [], [], True
        for _ in range(runs):
            t0 = time.perf_counter()
            one_by_one = [list(engine.generate(**r)) for r in requests]
            alone.append(concurrency * n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            batched = Batch(engine, concurrency).run(requests)
            wall = time.perf_counter() - t0
            together.append(sum(e[-1].timings.n_decoded + 1 for e in batched) / wall)
            same &= [[e.token for e in x] for x in one_by_one] == [[e.token for e in x] for x in batched]
            if progress:
                progress(1)
        finals = [e[-1] for e in batched]
        rows.append({"config": c.name, "streams": concurrency, "aggregate_tok_s": statistics.median(together),
                     "one_by_one_tok_s": statistics.median(alone),
                     "stream_decode_tok_s": statistics.median(f.timings.decode_tok_s for f in finals),
                     "stream_ttft_s": statistics.median(f.timings.ttft_s for f in finals),
                     "k_mean": statistics.mean(f.stats.k_mean for f in finals), "same_as_alone": same})
    return {"n": n, "runs": runs, "concurrency": concurrency, "rows": rows}


def concurrent_table(result: dict) -> str:
    lines = [f"{result['concurrency']} streams at once of {result['n']} greedy tokens, the prompts in a cycle; "
             f"medians of {result['runs']} runs, each beside the same streams one by one",
             f"{'config':24} {'aggregate tok/s':>16} {'one by one':>11} {'gain':>6} {'per stream':>11} "
             f"{'TTFT s':>7} {'k mean':>7} {'same':>5}"]
    for r in result["rows"]:
        lines.append(f"{r['config']:24} {r['aggregate_tok_s']:16.2f} {r['one_by_one_tok_s']:11.2f} "
                     f"{r['aggregate_tok_s'] / r['one_by_one_tok_s']:5.2f}x {r['stream_decode_tok_s']:11.2f} "
                     f"{r['stream_ttft_s']:7.2f} {r['k_mean']:7.2f} {'yes' if r['same_as_alone'] else 'NO':>5}")
    return "\n".join(lines)


def _row(prompt: str, c: BenchConfig, measured, plain_tokens, engine) -> dict:
    decode = [final.timings.decode_tok_s for _, final in measured]
    e2e = [(final.timings.n_decoded + 1) / (final.timings.ttft_s + final.timings.decode_s) for _, final in measured]
    tokens, final = measured[-1]
    s = final.stats
    source = s.sources.most_common(1)[0][0] if s.sources else None
    return {
        "prompt": prompt, "config": c.name, "source": c.source, "k": c.k,
        "decode_tok_s": statistics.median(decode), "decode_min": min(decode), "decode_max": max(decode),
        "e2e_tok_s": statistics.median(e2e), "ttft_s": statistics.median(f.timings.ttft_s for _, f in measured),
        "prefill_tok_s": statistics.median(f.timings.prefill_tok_s for _, f in measured),
        "prompt_n": final.timings.prompt_n,
        "acceptance": statistics.median(f.stats.acceptance_rate for _, f in measured),
        "tokens_per_round": statistics.median(f.stats.mean_accepted_length for _, f in measured),
        "k_mean": statistics.median(f.stats.k_mean for _, f in measured),
        "accept_per_position": s.accept_per_position,
        "same_as_plain": None if plain_tokens is None else tokens == plain_tokens,
        # what the last run did, for the roofline: target passes and draft-model passes (about one per token)
        "n_decoded": final.timings.n_decoded, "rounds": s.rounds, "plain_steps": s.plain_steps,
        "draft_passes": s.drafted_by.get("draft", 0),
        "model": _speed_model(engine.policy, source, c, s.k_mean),
    }


def _speed_model(policy, source: str | None, c: BenchConfig, k_mean: float) -> dict:
    """What the policy measured (seconds, and acceptance per position) for this configuration's source."""
    if source is None or source not in policy.t_draft:
        return {}
    k = c.k if c.k is not None else max(1, round(k_mean))
    # t_draft_s: a drafted token's share (a block drafter's round costs one pass whatever k: policy.draft_seconds)
    return {"source": source, "k": k, "t_verify_s": dict(policy.t_verify),
            "t_draft_s": policy.draft_seconds(source, k) / k,
            "t_catch_up_s": policy.t_catch_up.get(source, 0.0),
            "expected_tokens_per_round": policy.expected_length(source, k),
            "acceptance": policy.acceptance(source, k)}


def _speedups(rows: list[dict]) -> None:
    """Measured speed-up against plain on the same prompt, and the speed-up the measured model predicts:
    speed.speedup with v(k) and r relative to t_plain, the plain configuration's median step."""
    for r in rows:
        plain = next((x for x in rows if x["prompt"] == r["prompt"] and x["source"] == "none"), None)
        r["speedup"] = r["decode_tok_s"] / plain["decode_tok_s"] if plain else None
        r["predicted_speedup"] = 1.0 if r["source"] == "none" else None
        m = r["model"]
        if plain and m:
            t_plain = 1.0 / plain["decode_tok_s"]
            t_verify = m["t_verify_s"].get(m["k"])
            if t_verify is not None:
                r["v_k"] = t_verify / t_plain
                r["r"] = m["t_draft_s"] / t_plain
                r["predicted_speedup"] = speed.speedup(m["expected_tokens_per_round"], r["v_k"], m["k"], r["r"],
                                                       m["t_catch_up_s"] / t_plain)


def _summary(rows: list[dict], configs: list[BenchConfig]) -> list[dict]:
    out = []
    for c in configs:
        mine = [r for r in rows if r["config"] == c.name]
        speedups = [r["speedup"] for r in mine if r["speedup"] is not None]
        out.append({"config": c.name, "decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
                    "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in mine),
                    "speedup": statistics.median(speedups) if speedups else None,
                    "acceptance": statistics.median(r["acceptance"] for r in mine),
                    "all_same_as_plain": all(r["same_as_plain"] is not False for r in mine)})
    return out


def table(result: dict) -> str:
    lines = [f"{'prompt':11} {'config':22} {'decode tok/s':>12} {'(min-max)':>13} {'e2e':>6} {'TTFT s':>7} "
             f"{'prefill':>8} {'x plain':>7} {'pred.':>6} {'accept':>6} {'tok/rnd':>7} {'k':>4}  same"]
    for r in result["rows"]:
        spread = f"{r['decode_min']:.1f}-{r['decode_max']:.1f}"
        pred = f"{r['predicted_speedup']:.2f}" if r.get("predicted_speedup") else "-"
        same = {None: "-", True: "yes", False: "NO"}[r["same_as_plain"]]
        speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else "-"
        lines.append(f"{r['prompt']:11} {r['config']:22} {r['decode_tok_s']:12.2f} {spread:>13} {r['e2e_tok_s']:6.2f} "
                     f"{r['ttft_s']:7.2f} {r['prefill_tok_s']:8.1f} {speedup:>7} {pred:>6} {100 * r['acceptance']:5.0f}% "
                     f"{r['tokens_per_round']:7.2f} {r['k_mean']:4.1f}  {same}")
    lines.append("")
    lines.append(f"medians over prompts ({result['runs']} runs each, {result['n']} tokens, after "
                 f"{result['warmup']} warm-up):")
    for s in result["summary"]:
        speedup = f"{s['speedup']:.2f}x plain" if s["speedup"] is not None else ""
        lines.append(f"  {s['config']:22} {s['decode_tok_s']:7.2f} tok/s decode, {s['e2e_tok_s']:7.2f} end to end "
                     f"{speedup:>12}  acceptance {100 * s['acceptance']:3.0f}%"
                     + ("" if s["all_same_as_plain"] else "  OUTPUT DIFFERS FROM PLAIN"))
    if result.get("graphs_off"):
        lines.append(f"CUDA graphs were off for the target ({result['graphs_off']}): these are eager passes")
    return "\n".join(lines)


def roofline_table(result: dict) -> str:
    """The roofline section: bandwidth, the plain limit, per configuration the bytes read per emitted token
    and the share of the bandwidth achieved, and v(k)."""
    roof = result["roofline"]
    lines = [f"roofline: memory bandwidth {roof['bandwidth_gb_s']:.1f} GB/s (measured now); a target pass reads "
             f"{roof['target_pass_bytes'] / 1e6:.0f} MB, a draft pass {roof['draft_pass_bytes'] / 1e6:.0f} MB; "
             f"plain decoding's limit {roof['plain_limit_tok_s']:.1f} tok/s; a lone target pass "
             f"({1000 * roof['t_pass_s']:.0f} ms) runs at {100 * roof['plain_pass_share']:.0f}% of the bandwidth",
             f"{'config':22} {'tok/s':>7} {'MB/token':>9} {'GB/s':>6} {'of bw':>6}"]
    for c in result["configs"]:
        mine = [r for r in result["rows"] if r["config"] == c and "bytes_per_token" in r]
        if mine:
            lines.append(f"{c:22} {statistics.median(r['decode_tok_s'] for r in mine):7.2f} "
                         f"{statistics.median(r['bytes_per_token'] for r in mine) / 1e6:9.0f} "
                         f"{statistics.median(r['gb_s'] for r in mine):6.1f} "
                         f"{100 * statistics.median(r['bandwidth_share'] for r in mine):5.0f}%")
    lines.append("v(k), a pass over k + 1 tokens in single-token passes: "
                 + ", ".join(f"{k}: {v:.2f}" for k, v in roof["v"].items()))
    return "\n".join(lines)


def plots(result: dict, directory: Path) -> list[Path]:
    """tok/s against k per draft source, acceptance per draft position, measured against predicted speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows, written = result["rows"], []

    def save(fig, name):
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    for source in SOURCES:
        ks = sorted({r["k"] for r in rows if r["source"] == source and r["k"] is not None})
        if ks:
            ax.plot(ks, [statistics.median(r["decode_tok_s"] for r in rows if r["source"] == source and r["k"] == k)
                         for k in ks], marker="o", label=source)
        adaptive = [r["decode_tok_s"] for r in rows if r["source"] == source and r["k"] is None]
        if adaptive:
            ax.axhline(statistics.median(adaptive), linestyle=":", label=f"{source} adaptive")
    plain = [r["decode_tok_s"] for r in rows if r["source"] == "none"]
    if plain:
        ax.axhline(statistics.median(plain), color="black", linestyle="--", label="plain")
    ax.set(xlabel="k (tokens drafted per round)", ylabel="decode tok/s (median over prompts)",
           title="Speed against k")
    ax.legend(fontsize=8)
    save(fig, "tokps_vs_k.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for config in result["configs"]:
        per_prompt = [r["accept_per_position"] for r in rows if r["config"] == config and r["accept_per_position"]]
        if per_prompt:
            width = max(len(p) for p in per_prompt)
            ax.plot(range(1, width + 1), [statistics.mean(p[i] for p in per_prompt if i < len(p))
                                          for i in range(width)], marker=".", label=config)
    ax.set(xlabel="draft position", ylabel="acceptance (of rounds reaching it)", ylim=(0, 1.05),
           title="Acceptance per draft position")
    ax.legend(fontsize=8)
    save(fig, "acceptance_by_position.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    points = [(r["predicted_speedup"], r["speedup"], r["config"]) for r in rows
              if r.get("predicted_speedup") and r["speedup"] is not None]
    for config in result["configs"]:
        xs = [p for p, _, c in points if c == config]
        ys = [m for _, m, c in points if c == config]
        if xs:
            ax.scatter(xs, ys, label=config, s=18)
    top = max([1.0] + [max(p, m) for p, m, _ in points]) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.set(xlabel="predicted speed-up (measured v(k), r, acceptance)", ylabel="measured speed-up",
           xlim=(0, top), ylim=(0, top), title="Measured against predicted")
    ax.legend(fontsize=7)
    save(fig, "predicted_vs_measured.png")
    return written
