"""logits -> processed probabilities -> token.

The same processing feeds every consumer of a distribution (plain sampling now; the draft's
proposal and the target's verification in speculative decoding), which is what keeps speculative
output exact. The chain, in order: penalties (repetition, presence, frequency), temperature, top-k, top-p, min-p.
Temperature 0 is greedy: the processed distribution is one-hot on the argmax.
"""

from __future__ import annotations

import torch

from quickdraft.config import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """llama.cpp's repeat penalty: each distinct recent token's logit is divided (if > 0) or multiplied by it."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    ids = history.unique().expand(logits.shape[0], -1)
    seen = logits.gather(-1, ids)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, ids, seen)


def apply_presence_frequency(logits: torch.Tensor, history: torch.Tensor, presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI's penalties: logit -= frequency * count + presence * (count > 0), per token in history."""
    if (presence == 0.0 and frequency == 0.0) or history.numel() == 0:
        return logits
    counts = torch.bincount(history, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def history(seq: list[int], params: SamplingParams, device, appended: list[int] = ()) -> torch.Tensor | None:
    """The tokens the penalties look at: the end of seq, then `appended` (None when they are off).

    Enough of seq is kept that every prefix ending inside `appended` still has a full window.
    """
    if not params.penalized:
        return None
    w = params.repetition_window
    window = (seq[-(w + len(appended)):] if w > 0 else seq) + list(appended)
    return torch.tensor(window, dtype=torch.long, device=device)


def penalize(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None) -> torch.Tensor:
    """The penalties over the last `repetition_window` tokens of history (all if the window is 0), as
    llama.cpp applies them: repetition first, then presence and frequency."""
    if history is None or not params.penalized:
        return logits
    window = history[-params.repetition_window:] if params.repetition_window > 0 else history
    logits = apply_repetition_penalty(logits, window, params.repetition_penalty)
    return apply_presence_frequency(logits, window, params.presence_penalty, params.frequency_penalty)


def process(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None = None) -> torch.Tensor:
    """Float logits (N, V) -> processed probabilities (N, V), each row summing to 1."""
    # finite (a tiny repetition penalty divides logits into infinities), then shifted so that the largest
    # is 0: a tiny temperature then sends the others to -inf, never inf - inf = NaN
    logits = penalize(logits.float(), params, history).clamp(-3e38, 3e38)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = (logits - logits.amax(-1, keepdim=True)) / max(params.temperature, 1e-30)  # 1e-300 is 0 in float32
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # keep a token while the mass before it < p
        cut = mass_before >= params.top_p
        cut[..., 0] = False  # the most likely token always stays (a tiny top-p is 0 in float32: nothing would)
        drop = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, cut)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs (N, V) -> (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None,
               generator: torch.Generator | None, position: int) -> torch.Tensor:
    """Logits (1, V) -> token (1,) at sequence index `position`, from the processed distribution (greedy:
    the argmax, no softmax; seeded: the Gumbel choice of that position; else a draw from generator)."""
    if params.greedy:
        return penalize(logits, params, history).argmax(-1)
    probs = process(logits, params, history)
    if params.seed is not None:
        return gumbel_choice(probs, params.seed, position)
    return sample(probs, generator)


def gumbel_choice(probs: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """How a seeded generation samples: row i of probs (N, V) is the distribution at sequence index
    first_position + i; the token is argmax(log p + g), g Gumbel noise that depends on (seed, index) only.

    That is an exact draw from p (the Gumbel-max trick), and the noise of an index is the same whoever asks:
    a plain step, a round of any k, or the draft sampling its guess. So the target's choice at each index
    does not depend on how speculation went, and a seeded generation is reproducible, and identical with
    speculation on or off, token for token.
    """
    rows = [probs[i].log() + _gumbel(seed, first_position + i, probs.shape[-1], probs.device)
            for i in range(probs.shape[0])]
    return torch.stack(rows).argmax(-1)


def _gumbel(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    mixed = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) % 2**64  # decorrelate nearby seeds
    u = torch.rand(vocab, generator=torch.Generator(device=device).manual_seed(mixed), device=device)
    return -(-u.log()).log()  # u = 0 gives -inf: never chosen


class Generators:
    """A generation's random generators for unseeded draws, one per device: a draft on another device than the
    target's (--draft-device) draws with its own, since torch.multinomial takes only a generator of its tensor's
    device. Each is made on first use (make_generator)."""

    def __init__(self, seed: int | None):
        self.seed = seed
        self.made: dict[str, torch.Generator] = {}

    def on(self, device) -> torch.Generator:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current card
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        if key not in self.made:
            self.made[key] = make_generator(self.seed, device)
        return self.made[key]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """The generator of an unseeded draw (seeded generations use gumbel_choice): seeded from torch's global
    generator, itself random per process unless a caller fixed it with torch.manual_seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
    return generator
