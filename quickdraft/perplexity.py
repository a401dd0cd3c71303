"""Perplexity as llama.cpp computes it: the text in windows of n_ctx tokens, the second half of each scored."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache


@dataclass
class PerplexityResult:
    ppl: float
    tokens: int  # tokens scored
    chunks: int
    nll: float  # mean negative log-likelihood (nats)


def window_nll(logits: torch.Tensor, window: torch.Tensor, first: int) -> torch.Tensor:
    """Summed NLL of window[first+1:] given the logits (S, V) computed over the whole window."""
    logprobs = torch.log_softmax(logits[first:-1].float(), dim=-1)
    return -logprobs.gather(-1, window[first + 1:, None]).sum()


@torch.inference_mode()
def perplexity(model, tokens: list[int], ctx: int, bos_id: int | None = None,
               max_chunks: int | None = None, progress=None) -> PerplexityResult:
    """llama-perplexity's method: tokens is the text as it tokenizes it (with BOS where the model adds one), cut into
    windows of ctx tokens from the first; each window starts fresh, its first token replaced by BOS when the model
    uses one (the first window's already is), and tokens from ctx/2 on are scored, so every scored token has at least
    ctx/2 tokens of context."""
    if ctx < 8:
        raise QuickdraftError(f"{{context}} {ctx} is too small: use at least 8", "context")
    chunks = len(tokens) // ctx
    if chunks == 0:
        raise QuickdraftError(
            f"the text has {len(tokens)} tokens, fewer than {{context}} {ctx}: use a smaller {{context}} or a longer "
            "text", "context")
    chunks = min(chunks, max_chunks or chunks)
    device = model.device
    cache = KVCache.for_model(model, ctx)
    total, scored = 0.0, 0
    first = ctx // 2
    for c in range(chunks):
        window = torch.tensor(tokens[c * ctx:(c + 1) * ctx], device=device)
        if bos_id is not None:
            window[0] = bos_id
        cache.reset()
        logits = model(window[None], cache)[0]
        total += float(window_nll(logits, window, first))
        scored += ctx - first - 1
        if progress is not None:
            progress(c + 1)
    nll = total / scored
    return PerplexityResult(ppl=math.exp(nll), tokens=scored, chunks=chunks, nll=nll)
