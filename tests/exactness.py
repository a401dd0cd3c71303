"""Speculative output against plain decoding, with what a mismatch needs to be understood from one GPU run.

On a GPU a pass's shape decides its arithmetic, so `ours == plain` can fail two ways: a near-tie flipped by a pass
computed another way (a graph, an eagerly padded pass, an unpadded one near a cache's end), or a real bug. `check`
compares the two generations and, where they differ, appends to $QUICKDRAFT_CHECK_OUT/exact_diff.json (gpu_check.sh
sets it): the first differing index and its position, the round and k that gave each run's token there, the pass
that computed that row in each run (its first position, rows and path), the top-2 logits there and their margin,
and both tails from there on. Then the test fails with a line that says the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TAIL = 12  # tokens of each run kept from the first difference
NEAR_TIE = 2 ** -6  # a top-2 margin within this share of the top logit: a few bf16 roundings apart


class Passes:
    """While active, records every pass of a LoadedModel (its `forward`, which the engine, prefill and batched passes
    all go through): the cache, its first index, its rows, the path it takes, and the top-2 logits of each row it
    returns."""

    def __init__(self, lm):
        self.lm, self.passes = lm, []

    def __enter__(self) -> "Passes":
        lm, original = self.lm, self.lm.forward

        def forward(tokens, cache, last_only=False, head=None):
            path, start, rows = path_of(lm, tokens, cache, head), cache.length, tokens.shape[1]
            logits = original(tokens, cache, last_only, head)
            top2 = logits[0].float().topk(2, dim=-1).values if logits.shape[-1] > 1 else None  # (rows, 2)
            self.passes.append({"cache": id(cache), "start": start, "rows": rows, "path": path,
                                "first": start + rows - logits.shape[1], "top2": top2})
            return logits

        self.saved = lm.__dict__.get("forward")  # an outer Passes' own: recording nests
        lm.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            del self.lm.forward
        else:
            self.lm.forward = self.saved

    def at(self, index: int) -> dict | None:
        """The last pass over the target's cache (the first pass's: the target prefills first) whose returned rows
        hold index: the row whose logits chose the token at index + 1."""
        if not self.passes:
            return None
        cache = self.passes[0]["cache"]
        hits = [p for p in self.passes if p["cache"] == cache and p["first"] <= index < p["start"] + p["rows"]]
        if not hits:
            return None
        hit = hits[-1]
        top2 = hit["top2"][index - hit["first"]].tolist() if hit["top2"] is not None else None
        return {"start": hit["start"], "rows": hit["rows"], "path": hit["path"], "top2": top2,
                "margin": top2[0] - top2[1] if top2 else None}


def path_of(lm, tokens, cache, head=None) -> str:
    """Which way LoadedModel.forward computes this pass: a replayed graph, an eager pass padded to the row tile, or an
    eager pass of its own rows (near a cache's end, or without a row tile)."""
    from quickdraft.models.transformer import Transformer

    if head is None and lm.graphs is not None and lm.graphs.applies(tokens, cache):
        return "graph"
    rows, width = tokens.shape[1], lm.rows
    if (width is not None and rows < width and tokens.shape[0] == 1 and isinstance(lm.model, Transformer)
            and cache.length + width <= cache.capacity and cache.position + width <= lm.model.max_context):
        return f"padded eager ({rows} of {width} rows)"
    return f"unpadded eager ({rows} rows)"


def generate(engine, params, prompt) -> tuple[list[int], list]:
    """The tokens and every event of one generation (each event's step and k say which round gave it)."""
    events = list(engine.generate(prompt, params))
    return [e.token for e in events if e.token is not None], [e for e in events if e.token is not None] + events[-1:]


def same_as_plain(target, ours_engine, params, prompt, plain_engine=None, label: str = ""):
    """Plain decoding (plain_engine, else a fresh Engine on target), then ours_engine on the same prompt, each traced;
    `check` them. Returns ours' last event (finish reason, stats)."""
    from quickdraft.engine import Engine

    with Passes(target) as plain_passes:
        plain, plain_events = generate(plain_engine or Engine(target, ours_engine.capacity), params, prompt)
    with Passes(target) as our_passes:
        ours, our_events = generate(ours_engine, params, prompt)
    check(ours, plain, len(prompt), (our_events, our_passes), (plain_events, plain_passes), target, label)
    return our_events[-1]


def check(ours, plain, prompt_n, our_run, plain_run, target, label: str = "") -> None:
    if ours == plain:
        return
    i = next((j for j in range(min(len(ours), len(plain))) if ours[j] != plain[j]), min(len(ours), len(plain)))
    index = prompt_n + i - 1  # the row whose logits chose token i
    diff = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0], "label": label,
            "first_difference": i, "position": index + 1, "lengths": [len(ours), len(plain)],
            "ours": _side(our_run, i, index), "plain": _side(plain_run, i, index),
            "tails": {"ours": ours[i:i + TAIL], "plain": plain[i:i + TAIL]},
            "target": {"weights": target.weights, "rows": target.rows,
                       "graphs_disabled": target.graphs.disabled if target.graphs is not None else "no graphs"}}
    _append(diff)
    found = [diff[s]["pass"] for s in ("ours", "plain")]
    ties = [p is not None and p["margin"] is not None and p["margin"] <= NEAR_TIE * abs(p["top2"][0]) for p in found]
    pytest.fail(f"{label or 'speculation'}: differs from plain decoding at token {i} (position {index + 1}): "
                f"ours {ours[i:i + 6]}, plain {plain[i:i + 6]}; passes there: ours {found[0]}, plain {found[1]}"
                f"{'; a near-tie: the row computed another way' if any(ties) else '; no near-tie: a bug'} "
                "(exact_diff.json has both runs' rounds and tails)", pytrace=False)


def _side(run, i: int, index: int) -> dict:
    events, passes = run
    event = events[i] if i < len(events) - 1 else None
    return {"step": getattr(event, "step", None), "k": getattr(event, "k", None),
            "source": getattr(event, "source", None), "pass": passes.at(index)}


def _append(diff: dict) -> None:
    folder = os.environ.get("QUICKDRAFT_CHECK_OUT")
    if not folder:
        return
    path = Path(folder) / "exact_diff.json"
    diffs = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    path.write_text(json.dumps(diffs + [diff], indent=1, default=str), encoding="utf-8")
