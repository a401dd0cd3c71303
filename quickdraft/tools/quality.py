"""How far a runtime weight format moves a model from bf16 on a fixed text (`TEXT`): perplexity and the KL
divergence of every next-token distribution from bf16's, with the share of positions whose top token agrees.
`tune --formats` weighs a format's speed against these.

The text is cut into windows of WINDOW tokens, each run fresh; every position from CONTEXT on is scored (rather
than llama.cpp's second half of each window: the comparison is between formats on the same positions, and twice
the positions halve the noise). Perplexity over under a thousand tokens is still coarse (a code moved by one step
here and there changes it by a percent or so), so the KL divergence at every position, which is steadier, is
printed beside it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from quickdraft.perplexity import window_nll
from quickdraft.runtime.kv_cache import KVCache

TEXT = Path(__file__).resolve().parents[1] / "data" / "ppl.txt"
WINDOW = 256  # tokens per window: each starts fresh
CONTEXT = 32  # positions scored from this one on: each with at least this many tokens before it


@dataclass
class Quality:
    ppl: float  # the format's perplexity on the text
    ppl_bf16: float  # bf16's, on the same windows
    kl: float  # mean KL(bf16 || format) per position, nats
    top1: float  # share of positions where both put the same token first
    tokens: int  # positions compared

    @property
    def ppl_increase(self) -> float:
        """Perplexity above bf16's, in percent."""
        return 100 * (self.ppl / self.ppl_bf16 - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "ppl_increase": self.ppl_increase}


def text_tokens(tokenizer) -> list[int]:
    """The fixed text's tokens, in whole windows."""
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_bos=False)
    return ids[: len(ids) // WINDOW * WINDOW]


@torch.inference_mode()
def log_probs(model, tokens: list[int]) -> list[torch.Tensor]:
    """Per window, the model's float32 log-probabilities (WINDOW, V) at every position."""
    cache = KVCache.for_model(model, WINDOW)
    out = []
    for i in range(0, len(tokens), WINDOW):
        cache.reset()
        logits = model(torch.tensor([tokens[i:i + WINDOW]], device=model.device), cache)[0]
        out.append(torch.log_softmax(logits.float(), -1).cpu())
    return out


def perplexity_of(lps: list[torch.Tensor], tokens: list[int]) -> float:
    """Perplexity of tokens under the log-probabilities (log_probs' windows), from position CONTEXT of each."""
    total, scored = 0.0, 0
    for w, lp in enumerate(lps):
        window = torch.tensor(tokens[w * WINDOW:(w + 1) * WINDOW])
        total += float(window_nll(lp, window, CONTEXT - 1))  # log_softmax of log-probabilities is themselves
        scored += WINDOW - CONTEXT
    return math.exp(total / scored)


def compare(model, tokens: list[int], reference: list[torch.Tensor]) -> Quality:
    """model's quality against the bf16 log-probabilities `reference` (log_probs of the bf16 load, same tokens)."""
    mine = log_probs(model, tokens)
    kl = top1 = 0.0
    n = 0
    for ref, lp in zip(reference, mine):
        kl += float((ref.exp() * (ref - lp)).sum(-1).sum())
        top1 += float((ref.argmax(-1) == lp.argmax(-1)).sum())
        n += ref.shape[0]
    return Quality(perplexity_of(mine, tokens), perplexity_of(reference, tokens), kl / n, top1 / n, n)
