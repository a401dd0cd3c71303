"""The generation loop: prefill, then rounds of draft -> verify -> accept -> rollback (or plain steps)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch

from quickdraft import constraint as constraints, sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.errors import QuickdraftError
from quickdraft.constraint import Constraint, GrammarCompiler
from quickdraft.grammar import Grammar
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import Slot, Slots
from quickdraft.speculative.accept import accept_greedy, accept_sampled
from quickdraft.speculative.base import Drafter, Proposal
from quickdraft.speculative.policy import AdaptivePolicy
from quickdraft.speculative.stats import SpeculationStats

if TYPE_CHECKING:  # the engine runs whatever model it is given; it does not load one
    from quickdraft.weights.loader import LoadedModel


def draft_budget(max_tokens: int, generated: int, room: int) -> int:
    """Most tokens a round may draft: one fewer than the tokens still to generate (the round's last token is the
    target's), and no more than the cache has room for. tune's replay follows the same rule."""
    return min(max_tokens - generated - 1, room)


@dataclass
class Timings:
    prompt_n: int = 0
    cache_n: int = 0  # of them, tokens a kept slot already held (prefix reuse): not prefilled again
    ttft_s: float = 0.0  # start of generate -> first token chosen (prefill included)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token -> last token
    n_decoded: int = 0  # tokens generated after the first one
    draft_prefill_s: float = 0.0  # the draft taking in the prompt, after the first token (part of decode_s)

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


@dataclass
class Sequence:
    """Everything one generation owns (DESIGN: a sequence is an object): its tokens, the slot whose cache holds them
    (and whose drafter speaks for them), how to sample and with which generators, its constraint, its statistics,
    timings and detokenizer."""

    prompt: list[int]
    params: SamplingParams
    speculation: SpeculationConfig
    slot: Slot
    drafter: Drafter | None  # the slot's drafter while this generation speculates, else None
    constraint: Constraint | None
    halt: Halt
    eos: frozenset
    generators: sampling.Generators
    stats: SpeculationStats
    timings: Timings
    detok: Detokenizer
    tokens: list[int] = field(default_factory=list)  # the prompt, then each token generated so far
    pending: list[int] = field(default_factory=list)  # the current step's tokens not yet taken into tokens

    @property
    def cache(self) -> KVCache:
        return self.slot.cache

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


class Engine:
    """Generates from a target model, speculatively when given a drafter.

    A sequence's cache (its slot's: runtime/slots.py) always holds every token of it but the last, which is the input
    of the next target pass (a plain step feeds it alone; a round feeds it with the drafts). Slots outlive their
    generations: a prompt that begins with tokens a slot holds prefills only the rest (`reuse`), with the same output
    as from an empty cache.
    """

    def __init__(self, target: LoadedModel, context: int | None = None, drafter: Drafter | None = None,
                 speculation: SpeculationConfig = SpeculationConfig(), slots: int = 1):
        """slots: how many sequences to keep for reuse (each a KV cache of `context` positions, and its drafter's)."""
        self.target = target
        self.capacity = context or target.model.max_context
        self.drafter = drafter  # speaks for the first slot; each further slot drafts with a fork of it
        self.slots = Slots(self._slot, slots)
        first, _ = self.slots.take([], reuse=False)  # made now: its cache is the one tools ask for before generating
        # a hybrid target's or draft's recurrent state rolls back a bounded number of positions, and on CUDA a pass
        # has at most target.rows rows (LoadedModel.rows): k stays within both
        bounds = (first.cache.max_draft, drafter.max_draft if drafter is not None else None,
                  target.rows - 1 if target.rows is not None else None)
        reach = [m for m in bounds if m is not None]
        self.max_draft = min(reach) if reach else None
        self.speculation = speculation
        self.policy = AdaptivePolicy(speculation)  # its timings describe this machine: kept across generations
        self.grammars = GrammarCompiler(target.tokenizer, target.config.vocab_size)
        self._masker: ThreadPoolExecutor | None = None  # computes verification masks during the target pass
        self.last = first  # the slot of the latest generation

    def _slot(self) -> Slot:
        cache = KVCache.for_model(self.target.model, self.capacity)
        drafter = self.drafter if not self.slots.slots else self.drafter.fork() if self.drafter is not None else None
        if drafter is not None and drafter.reads_hidden:  # built-in drafters (mtp) read the target's hidden states
            drafter.attach(cache)
        return Slot(cache, drafter)

    @property
    def cache(self) -> KVCache:
        """The cache of the latest generation's slot."""
        return self.last.cache

    @property
    def context(self) -> int:
        return self.capacity

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
                 halt: Halt | None = None, constraint: Constraint | None = None, reuse: bool = True) -> Iterator[Event]:
        """Yield an Event per generated token, then a final Event with finish_reason, timings and speculation
        stats.

        speculation overrides the engine's settings for this generation (draft_max 0: none); halt ends the
        generation early with halt.reason as its finish reason; constraint (from self.constraint) restricts the
        output to a grammar: it ends with "stop" once the output is complete; reuse False prefills the whole prompt
        (a kept slot is not looked for; the output is the same either way).
        """
        self.check_fits(len(prompt), params.max_tokens)
        s = self._sequence(prompt, params, speculation or self.speculation, halt or Halt(), constraint, reuse)
        try:
            yield from self._run(s)
        except GeneratorExit:  # the caller stopped reading at a token: the cache is whole
            raise
        except BaseException:
            s.slot.forget()  # a pass may have stopped half way: nothing the cache holds is known
            raise
        finally:
            self._release(s)

    def _sequence(self, prompt, params, speculation, halt, constraint, reuse) -> Sequence:
        slot, reused = self.slots.take(prompt, reuse)
        self.last = slot
        drafter = slot.drafter if speculation.draft_max > 0 else None
        eos = self.target.tokenizer.eos_ids if params.stop_at_eos else frozenset()
        if constraint is not None:  # the output ends where the grammar allows an end and the model takes it
            eos = self.target.tokenizer.eos_ids | constraint.eos_ids
        stats = SpeculationStats(drafter=self.drafter_name if drafter else "none",
                                 draft_device=str(drafter.device) if drafter and drafter.device else None)
        return Sequence(list(prompt), params, speculation, slot, drafter, constraint, halt, eos,
                        sampling.Generators(params.seed), stats, Timings(prompt_n=len(prompt), cache_n=reused),
                        Detokenizer(self.target.tokenizer), list(prompt))

    def _release(self, s: Sequence) -> None:
        """What the slot holds now: the tokens of its cache (the step's tokens not yet taken in included)."""
        s.slot.tokens[:] = (s.tokens + s.pending)[:s.slot.cache.length]
        s.slot.checkpoint()

    def _run(self, s: Sequence) -> Iterator[Event]:
        start = time.perf_counter()
        new_tokens, scores = self._prefill(s)
        t = s.timings
        origin, step, first = _TARGET, 0, None  # who proposed the tokens of this step (Event.source)
        finish = "length"
        while new_tokens:
            s.pending = list(new_tokens)
            for j, token in enumerate(new_tokens):
                now = time.perf_counter()
                if first is None:
                    t.prefill_s = t.ttft_s = now - start
                    first = now
                else:
                    t.decode_s, t.n_decoded = now - first, t.n_decoded + 1
                if token in s.eos:
                    finish = "stop"
                    break
                s.tokens.append(s.pending.pop(0))
                if s.constraint is not None:
                    s.constraint.advance(token)
                yield Event(token, s.detok.push(token), source=origin.source if j < origin.kept else "target",
                            step=step, k=origin.k, **_logprobs(scores, j, token, s.params.logprobs))
                if s.halt.reason is not None:
                    finish = s.halt.reason
                    break
                if s.constraint is not None and s.constraint.stopped:
                    finish = "stop"
                    break
                if s.generated == s.params.max_tokens:
                    break
            else:
                if step == 0 and s.drafter is not None:  # the draft takes in the prompt once the first token is out:
                    self._begin_drafting(s)  # the wait for the first token is the target's prefill alone
                new_tokens, scores, origin = self._step(s)
                step += 1
                continue
            break
        if first is None:  # max_tokens == 0
            t.prefill_s = t.ttft_s = time.perf_counter() - start
        s.stats.policy = self.policy.snapshot() if s.drafter is not None else {}
        if s.constraint is not None:
            s.stats.constraint = s.constraint.grammar.kind
            s.stats.mask_s, s.stats.masks_computed = s.constraint.seconds, s.constraint.masks_computed
        yield Event(None, s.detok.flush(), finish_reason=finish, timings=t, stats=s.stats)

    # ---- the pieces of the loop -------------------------------------------------------------

    def _prefill(self, s: Sequence):
        """The prompt's tokens the slot does not hold, in chunks; the first token from the last one's logits."""
        if s.params.max_tokens == 0:
            return [], None
        feed = torch.tensor(s.prompt[s.timings.cache_n:], device=self.target.device)
        logits = self.target.prefill(feed[None], s.cache)[0]
        s.slot.checkpoint()  # a turn boundary: the next turn of a hybrid's conversation restarts here at worst
        return self._choose(s, logits)

    def _begin_drafting(self, s: Sequence) -> None:
        t0 = time.perf_counter()
        s.drafter.begin(s.prompt)
        self.policy.begin()
        s.timings.draft_prefill_s = time.perf_counter() - t0

    def _choose(self, s: Sequence, logits) -> tuple[list[int], torch.Tensor | None]:
        """The target's token after s.tokens from its logits (1, V), as a plain step chooses it, and its scores."""
        raw = logits
        if s.constraint is not None:
            logits = constraints.apply(logits, s.constraint.allowed(logits.device))
        history = sampling.history(s.tokens, s.params, self.target.device)
        token = int(sampling.next_token(logits, s.params, history, s.generators.on(self.target.device), len(s.tokens)))
        return [token], self._scores(raw, logits, history, 0, s.params)

    def _scores(self, raw, masked, history, k: int, params: SamplingParams) -> torch.Tensor | None:
        """Log-probabilities (k + 1, V) of the positions a pass scored, when the request asks for them: from the raw
        logits, or (post_sampling) from the distribution each position's token is drawn from. Both are functions
        of the target's logits there alone, so a plain step and a round give the same."""
        if params.logprobs is None:
            return None
        if not params.post_sampling:
            return torch.log_softmax(raw.float(), -1)
        return self._per_position(masked, history, k, lambda x, h: sampling.process(x, params, h)).log()

    def _step(self, s: Sequence):
        """One plain step or one speculative round: the tokens it adds to s.tokens, their scores and their Origin."""
        budget = draft_budget(s.params.max_tokens, s.generated, self.context - len(s.tokens))
        if self.max_draft is not None:
            budget = min(budget, self.max_draft)

        def k_for(source: str) -> int:
            return max(0, min(self.policy.k_for(source, s.speculation), budget))

        proposal = Proposal([], "none")
        draft_s = 0.0
        if s.drafter is not None and budget > 0:
            t0 = time.perf_counter()
            # constrain_draft False drafts as llama.cpp does, blind to the grammar (for comparison)
            proposal = s.drafter.propose(s.tokens, k_for, s.params, s.generators.on(s.drafter.device or
                                                                                      self.target.device),
                                         s.constraint if s.speculation.constrain_draft else None)
            draft_s = time.perf_counter() - t0
        if not proposal.tokens:
            t0 = time.perf_counter()
            chosen = self._plain(s)
            seconds = time.perf_counter() - t0
            self.policy.record_plain(seconds + draft_s)
            s.stats.record_plain(seconds + draft_s)
            return (*chosen, _TARGET)
        t0 = time.perf_counter()
        tokens, accepted, scores = self._verify(s, proposal)
        verify_s = time.perf_counter() - t0
        k = len(proposal.tokens)
        self.policy.record_round(proposal.source, k, accepted, draft_s - proposal.catch_up_s, verify_s,
                                 proposal.catch_up_s)
        s.stats.record_round(proposal.source, k, accepted, len(tokens), draft_s, verify_s)
        return tokens, scores, Origin(proposal.source, accepted, k)

    def _plain(self, s: Sequence):
        logits = self.target.forward(torch.tensor([s.tokens[-1:]], device=self.target.device), s.cache)[0]
        return self._choose(s, logits)

    def _verify(self, s: Sequence, proposal: Proposal):
        """Run the target over the last token and the drafts, accept, and roll the cache back to match.

        Under a constraint every position is masked as a plain step there would be; the masks are computed
        on another thread while the target runs (llguidance releases the GIL).
        """
        device, params, seq = self.target.device, s.params, s.tokens
        masks = None
        if s.constraint is not None:
            if self._masker is None:  # its thread ends when the engine is collected (tests/test_grammar.py)
                self._masker = ThreadPoolExecutor(1, thread_name_prefix="quickdraft-mask")
            masks = self._masker.submit(s.constraint.lookahead_bitmasks, proposal.tokens)
        drafts = torch.tensor(proposal.tokens, device=device)
        feed = torch.cat([torch.tensor(seq[-1:], device=device), drafts])
        logits = raw = self.target.forward(feed[None], s.cache)[0]  # (k + 1, V)
        if masks is not None:
            logits = constraints.apply(logits, constraints.unpack(masks.result().to(device), logits.shape[-1]))
        k = len(proposal.tokens)
        history = sampling.history(seq, params, device, appended=proposal.tokens)
        scores = self._scores(raw, logits, history, k, params)
        if params.greedy:
            rows = self._per_position(logits, history, k, lambda x, h: sampling.penalize(x, params, h))
            tokens, accepted = accept_greedy(rows.argmax(-1), drafts)
        else:
            p_target = self._per_position(logits, history, k, lambda x, h: sampling.process(x, params, h))
            if params.seed is not None:  # the target's own seeded choices: keep the drafts that match them
                tokens, accepted = accept_greedy(sampling.gumbel_choice(p_target, params.seed, len(seq)), drafts)
            else:
                q_draft = proposal.q_rows(self.vocab, device).to(device)
                tokens, accepted = accept_sampled(p_target, q_draft, drafts, s.generators.on(device))
        s.cache.rollback(len(seq) + accepted)  # keep the last token and the accepted drafts
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
