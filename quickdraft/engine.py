"""The generation loop: prefill, then one token per target step (speculative rounds come next)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from quickdraft import sampling
from quickdraft.config import SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights.loader import LoadedModel


@dataclass
class Timings:
    prompt_n: int = 0
    ttft_s: float = 0.0  # start of generate -> first token chosen (prefill included)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token -> last token
    n_decoded: int = 0  # tokens generated after the first one

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}


@dataclass
class Event:
    """One step of a generation: a token and the text it completed, or (last) why it ended."""

    token: int | None
    text: str = ""
    finish_reason: str | None = None  # "stop" (end-of-generation token) or "length"
    timings: Timings | None = None


@dataclass
class Detokenizer:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences."""

    tokenizer: object
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # the token ends mid-character: wait for the rest
            return ""
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


class Engine:
    """Generates from one target model with a preallocated KV cache."""

    def __init__(self, target: LoadedModel, context: int | None = None):
        self.target = target
        self.cache = KVCache.for_model(target.model, context)

    @property
    def context(self) -> int:
        return self.cache.capacity

    def check_fits(self, prompt_n: int, max_tokens: int) -> None:
        if prompt_n == 0:
            raise QuickdraftError("the prompt is empty: give some text with -p or --prompt-file")
        if prompt_n + max_tokens > self.context:
            raise QuickdraftError(
                f"the prompt ({prompt_n} tokens) plus {max_tokens} new tokens exceeds the context of "
                f"{self.context} tokens: shorten the prompt, lower -n, or raise --ctx"
            )

    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[Event]:
        """Yield an Event per generated token, then a final Event with finish_reason and timings."""
        self.check_fits(len(prompt), params.max_tokens)
        model, device = self.target.model, self.target.device
        eos = self.target.tokenizer.eos_ids if params.stop_at_eos else frozenset()
        generator = sampling.make_generator(params.seed, device)
        history = torch.tensor(prompt, dtype=torch.long, device=device)
        detok = Detokenizer(self.target.tokenizer)
        timings = Timings(prompt_n=len(prompt))
        start = time.perf_counter()
        self.cache.reset()
        logits = model(history[None], self.cache, last_only=True)[0]  # (1, V)
        finish = "length"
        for i in range(params.max_tokens):
            token = int(sampling.next_token(logits, params, history, generator))
            now = time.perf_counter()
            if i == 0:
                timings.prefill_s = timings.ttft_s = now - start
                first = now
            else:
                timings.decode_s, timings.n_decoded = now - first, i
            if token in eos:
                finish = "stop"
                break
            yield Event(token, detok.push(token))
            if i + 1 == params.max_tokens:
                break
            history = torch.cat([history, history.new_tensor([token])])
            logits = model(history[-1:][None], self.cache)[0]
        yield Event(None, finish_reason=finish, timings=timings)
