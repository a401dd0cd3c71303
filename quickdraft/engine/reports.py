"""What a generation reports: an Event per token (and a last one with why it ended), its Timings, and where each
step's tokens came from (Origin)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from quickdraft.speculative.stats import SpeculationStats


@dataclass
class Timings:
    prompt_n: int = 0
    cache_n: int = 0  # of them, tokens a kept slot already held (prefix reuse): not prefilled again
    ttft_s: float = 0.0  # start of generate -> first token chosen (prefill included)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token -> last token
    n_decoded: int = 0  # tokens generated after the first one
    # a drafter taking in what it had not seen (the prompt, or its window of it; tokens of plain steps and of other
    # sources) before drafting: part of decode_s
    draft_prefill_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        """Tokens prefilled (those the slot did not hold) per second."""
        return (self.prompt_n - self.cache_n) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}


@dataclass
class Event:
    """One generated token and the text it completed, or (last) why the generation ended, with any text
    still held back (the tail of a character cut off by the end)."""

    token: int | None
    text: str = ""
    finish_reason: str | None = None  # "stop" (end-of-generation token) or "length"
    timings: Timings | None = None
    stats: SpeculationStats | None = None
    logprob: float | None = None  # with SamplingParams.logprobs: the token's log-probability
    top_logprobs: list[tuple[int, float]] | None = None  # and the likeliest tokens' there, most likely first
    # where the token came from: "target" (chosen by the target alone: the prefill, a plain step, or the token a
    # round adds after its kept drafts), else the drafter source whose draft the target kept ("draft", "ngram")
    source: str = "target"
    step: int = 0  # the pass that gave it: 0 the prefill, then one per plain step or speculative round
    k: int = 0  # the tokens drafted in that step (0: a plain step)


class Origin(NamedTuple):
    """Where a step's tokens came from: its first `kept` are drafts of `source` the target kept, out of k drafted."""
    source: str
    kept: int
    k: int


TARGET = Origin("target", 0, 0)  # the prefill or a plain step: the target's own token


def logprob_fields(scores: torch.Tensor | None, j: int, token: int, top: int | None) -> dict:
    """An Event's logprob fields for the j-th token a pass chose (none without scores)."""
    if scores is None:
        return {}
    row = scores[j]
    out = {"logprob": float(row[token])}
    if top:
        values, ids = row.topk(top)
        # post-sampling, tokens the sampler ruled out have -inf: they are not alternatives
        out["top_logprobs"] = [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
    return out
