"""The generation loop: prefill, then rounds of draft -> verify -> accept -> rollback (or plain steps)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Iterator, NamedTuple

import torch

from quickdraft import constraint as constraints, sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.errors import QuickdraftError
from quickdraft.constraint import Constraint, GrammarCompiler
from quickdraft.grammar import Grammar
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.accept import accept_greedy, accept_sampled
from quickdraft.speculative.base import Drafter, Proposal
from quickdraft.speculative.policy import AdaptivePolicy
from quickdraft.speculative.stats import SpeculationStats
from quickdraft.weights.loader import LoadedModel


def draft_budget(max_tokens: int, generated: int, room: int) -> int:
    """Most tokens a round may draft: one fewer than the tokens still to generate (the round's last token is the
    target's), and no more than the cache has room for. tune's replay follows the same rule."""
    return min(max_tokens - generated - 1, room)


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


@dataclass
class Halt:
    """Ends a generation after its current token: set `reason` (any thread may) to the finish reason to
    report, e.g. "stop" when a stop string matched or "cancelled" when the client went away."""

    reason: str | None = None


@dataclass
class Detokenizer:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences.

    Only a short window is decoded each time (the tokens after the last emitted piece, plus the few
    before them for context), so streaming stays O(1) per token however long the output grows.
    """

    tokenizer: object
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # ids[prefix:read] were decoded last time, as context for the next piece
    read: int = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or self._mid_character(text):  # wait for the rest of the character
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def _mid_character(self, text: str) -> bool:
        """The bytes so far end inside a character: known from the tokens' bytes where the tokenizer says (a real
        U+FFFD in the output is then streamed at once), else guessed from a trailing U+FFFD."""
        known = self.tokenizer.ends_mid_character(self.ids[self.read:])
        return text.endswith("\ufffd") if known is None else known

    def flush(self) -> str:
        """What is still held back when the generation ends (an incomplete character shows as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):] if len(text) > len(before) else ""


class Engine:
    """Generates from a target model, speculatively when given a drafter.

    The target's cache always holds every token of the sequence but the last, which is the input of the
    next target pass (a plain step feeds it alone; a round feeds it with the drafts).
    """

    def __init__(self, target: LoadedModel, context: int | None = None, drafter: Drafter | None = None,
                 speculation: SpeculationConfig = SpeculationConfig()):
        self.target = target
        self.cache = KVCache.for_model(target.model, context)
        self.drafter = drafter
        if drafter is not None and drafter.reads_hidden:  # built-in drafters (mtp) read the target's hidden states
            drafter.attach(self.cache)
        # a hybrid target's or draft's recurrent state rolls back a bounded number of positions, and on CUDA a pass
        # has at most target.rows rows (LoadedModel.rows): k stays within both
        bounds = (self.cache.max_draft, drafter.max_draft if drafter is not None else None,
                  target.rows - 1 if target.rows is not None else None)
        reach = [m for m in bounds if m is not None]
        self.max_draft = min(reach) if reach else None
        self.speculation = speculation
        self.policy = AdaptivePolicy(speculation)  # its timings describe this machine: kept across generations
        self.grammars = GrammarCompiler(target.tokenizer, target.config.vocab_size)
        self._masker: ThreadPoolExecutor | None = None  # computes verification masks during the target pass

    @property
    def context(self) -> int:
        return self.cache.capacity

    @property
    def drafter_name(self) -> str:
        """The draft as users write it (speculative/draft.py), "none" without one."""
        return self.drafter.name if self.drafter is not None else "none"

    @property
    def vocab(self) -> int:
        return self.target.config.vocab_size

    def check_fits(self, prompt_n: int, max_tokens: int) -> None:
        if prompt_n == 0:
            raise QuickdraftError("the prompt is empty: give some text with -p or --prompt-file")
        if prompt_n + max_tokens > self.context:
            raise QuickdraftError(
                f"the prompt ({prompt_n} tokens) plus {max_tokens} new tokens exceeds the context of "
                f"{self.context} tokens: shorten the prompt, lower -n, or raise --ctx"
            )

    def constraint(self, grammar: Grammar | None) -> Constraint | None:
        """A matcher for one generation (QuickdraftError, with the library's message, if the grammar is invalid)."""
        return self.grammars.constraint(grammar) if grammar is not None else None

    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams, speculation: SpeculationConfig | None = None,
                 halt: Halt | None = None, constraint: Constraint | None = None) -> Iterator[Event]:
        """Yield an Event per generated token, then a final Event with finish_reason, timings and speculation
        stats.

        speculation overrides the engine's settings for this generation (draft_max 0: none); halt ends the
        generation early with halt.reason as its finish reason; constraint (from self.constraint) restricts the
        output to a grammar: it ends with "stop" once the output is complete.
        """
        self.check_fits(len(prompt), params.max_tokens)
        speculation = speculation or self.speculation
        drafter = self.drafter if speculation.draft_max > 0 else None
        halt = halt or Halt()
        eos = self.target.tokenizer.eos_ids if params.stop_at_eos else frozenset()
        if constraint is not None:  # the output ends where the grammar allows an end and the model takes it
            eos = self.target.tokenizer.eos_ids | constraint.eos_ids
        generators = sampling.Generators(params.seed)  # the target's device's, and the draft's if it has another
        generator = generators.on(self.target.device)
        detok = Detokenizer(self.target.tokenizer)
        timings = Timings(prompt_n=len(prompt))
        stats = SpeculationStats(drafter=self.drafter_name if drafter else "none",
                          draft_device=str(drafter.device) if drafter and drafter.device else None)
        start = time.perf_counter()
        seq = list(prompt)
        new_tokens, scores = self._prefill(seq, params, generator, constraint)
        origin, step = _TARGET, 0  # who proposed the tokens of this step (Event.source)
        if drafter is not None:
            drafter.begin(prompt)
            self.policy.begin()
        finish, first = "length", None
        while new_tokens:
            for j, token in enumerate(new_tokens):
                now = time.perf_counter()
                if first is None:
                    timings.prefill_s = timings.ttft_s = now - start
                    first = now
                else:
                    timings.decode_s, timings.n_decoded = now - first, timings.n_decoded + 1
                if token in eos:
                    finish = "stop"
                    break
                seq.append(token)
                if constraint is not None:
                    constraint.advance(token)
                yield Event(token, detok.push(token), source=origin.source if j < origin.kept else "target",
                            step=step, k=origin.k, **_logprobs(scores, j, token, params.logprobs))
                if halt.reason is not None:
                    finish = halt.reason
                    break
                if constraint is not None and constraint.stopped:
                    finish = "stop"
                    break
                if len(seq) - len(prompt) == params.max_tokens:
                    break
            else:
                new_tokens, scores, origin = self._step(seq, params, generators, len(prompt), stats, drafter,
                                                        speculation, constraint)
                step += 1
                continue
            break
        if first is None:  # max_tokens == 0
            timings.prefill_s = timings.ttft_s = time.perf_counter() - start
        stats.policy = self.policy.snapshot() if drafter is not None else {}
        if constraint is not None:
            stats.constraint = constraint.grammar.kind
            stats.mask_s, stats.masks_computed = constraint.seconds, constraint.masks_computed
        yield Event(None, detok.flush(), finish_reason=finish, timings=timings, stats=stats)

    # ---- the pieces of the loop -------------------------------------------------------------

    def _prefill(self, seq: list[int], params: SamplingParams, generator, constraint):
        if params.max_tokens == 0:
            return [], None
        self.cache.reset()
        tokens = torch.tensor(seq, device=self.target.device)
        logits = self.target.forward(tokens[None], self.cache, last_only=True)[0]
        return self._choose(logits, seq, params, generator, constraint)

    def _choose(self, logits, seq, params, generator, constraint) -> tuple[list[int], torch.Tensor | None]:
        """The target's token after seq from its logits (1, V), as a plain step chooses it, and its scores."""
        raw = logits
        if constraint is not None:
            logits = constraints.apply(logits, constraint.allowed(logits.device))
        history = sampling.history(seq, params, self.target.device)
        token = int(sampling.next_token(logits, params, history, generator, len(seq)))
        return [token], self._scores(raw, logits, history, 0, params)

    def _scores(self, raw, masked, history, k: int, params: SamplingParams) -> torch.Tensor | None:
        """Log-probabilities (k + 1, V) of the positions a pass scored, when the request asks for them: from the raw
        logits, or (post_sampling) from the distribution each position's token is drawn from. Both are functions
        of the target's logits there alone, so a plain step and a round give the same."""
        if params.logprobs is None:
            return None
        if not params.post_sampling:
            return torch.log_softmax(raw.float(), -1)
        return self._per_position(masked, history, k, lambda x, h: sampling.process(x, params, h)).log()

    def _step(self, seq, params, generators: sampling.Generators, prompt_n: int, stats: SpeculationStats,
              drafter: Drafter | None, speculation: SpeculationConfig, constraint: Constraint | None):
        """One plain step or one speculative round: the tokens it adds to seq, their scores and their Origin."""
        generator = generators.on(self.target.device)
        budget = draft_budget(params.max_tokens, len(seq) - prompt_n, self.context - len(seq))
        if self.max_draft is not None:
            budget = min(budget, self.max_draft)

        def k_for(source: str) -> int:
            return max(0, min(self.policy.k_for(source, speculation), budget))

        proposal = Proposal([], "none")
        draft_s = 0.0
        if drafter is not None and budget > 0:
            t0 = time.perf_counter()
            # constrain_draft False drafts as llama.cpp does, blind to the grammar (for comparison)
            proposal = drafter.propose(seq, k_for, params, generators.on(drafter.device or self.target.device),
                                       constraint if speculation.constrain_draft else None)
            draft_s = time.perf_counter() - t0
        if not proposal.tokens:
            t0 = time.perf_counter()
            chosen = self._plain(seq, params, generator, constraint)
            seconds = time.perf_counter() - t0
            self.policy.record_plain(seconds + draft_s)
            stats.record_plain(seconds + draft_s)
            return (*chosen, _TARGET)
        t0 = time.perf_counter()
        tokens, accepted, scores = self._verify(seq, proposal, params, generator, constraint)
        verify_s = time.perf_counter() - t0
        k = len(proposal.tokens)
        self.policy.record_round(proposal.source, k, accepted, draft_s - proposal.catch_up_s, verify_s,
                                 proposal.catch_up_s)
        stats.record_round(proposal.source, k, accepted, len(tokens), draft_s, verify_s)
        return tokens, scores, Origin(proposal.source, accepted, k)

    def _plain(self, seq, params, generator, constraint):
        logits = self.target.forward(torch.tensor([seq[-1:]], device=self.target.device), self.cache)[0]
        return self._choose(logits, seq, params, generator, constraint)

    def _verify(self, seq, proposal: Proposal, params, generator, constraint):
        """Run the target over the last token and the drafts, accept, and roll the cache back to match.

        Under a constraint every position is masked as a plain step there would be; the masks are computed
        on another thread while the target runs (llguidance releases the GIL).
        """
        device = self.target.device
        masks = None
        if constraint is not None:
            if self._masker is None:
                self._masker = ThreadPoolExecutor(1, thread_name_prefix="quickdraft-mask")
            masks = self._masker.submit(constraint.lookahead_bitmasks, proposal.tokens)
        drafts = torch.tensor(proposal.tokens, device=device)
        feed = torch.cat([torch.tensor(seq[-1:], device=device), drafts])
        logits = raw = self.target.forward(feed[None], self.cache)[0]  # (k + 1, V)
        if masks is not None:
            logits = constraints.apply(logits, constraints.unpack(masks.result().to(device), logits.shape[-1]))
        k = len(proposal.tokens)
        history = sampling.history(seq, params, device, appended=proposal.tokens)
        scores = self._scores(raw, logits, history, k, params)
        if params.greedy:
            rows = self._per_position(logits, history, k, lambda x, h: sampling.penalize(x, params, h))
            tokens, accepted = accept_greedy(rows.argmax(-1), drafts)
            self.cache.rollback(len(seq) + accepted)
            return tokens, accepted, scores
        p_target = self._per_position(logits, history, k, lambda x, h: sampling.process(x, params, h))
        if params.seed is not None:  # the target's own seeded choices: keep the drafts that match them
            tokens, accepted = accept_greedy(sampling.gumbel_choice(p_target, params.seed, len(seq)), drafts)
        else:
            q_draft = proposal.q_rows(self.vocab, device).to(device)
            tokens, accepted = accept_sampled(p_target, q_draft, drafts, generator)
        self.cache.rollback(len(seq) + accepted)  # keep the last token and the accepted drafts
        return tokens, accepted, scores

    @staticmethod
    def _per_position(logits, history, k, fn):
        """Apply a processing step to each of the k + 1 positions with the history it would have had."""
        if history is None:
            return fn(logits, None)
        return torch.cat([fn(logits[i:i + 1], history[: history.shape[0] - k + i]) for i in range(k + 1)])


class Origin(NamedTuple):
    """Where a step's tokens came from: its first `kept` are drafts of `source` the target kept, out of k drafted."""
    source: str
    kept: int
    k: int


_TARGET = Origin("target", 0, 0)  # the prefill or a plain step: the target's own token


def _logprobs(scores: torch.Tensor | None, j: int, token: int, top: int | None) -> dict:
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
