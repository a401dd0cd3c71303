"""The generation loop: prefill, then rounds of draft -> verify -> accept -> rollback (or plain steps)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

import torch

from quickdraft import constraint as constraints, sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.errors import QuickdraftError
from quickdraft.constraint import Constraint, GrammarCompiler
from quickdraft.grammar import Grammar
from quickdraft.models.transformer import ROWWISE_MAX
from quickdraft.runtime.kv_cache import KVCache, TreeRows
from quickdraft.runtime.slots import Slot, Slots
from quickdraft.speculative.accept import accept_greedy, accept_sampled, accept_tree_greedy, accept_tree_sampled
from quickdraft.speculative.base import Drafter, KFor, Proposal
from quickdraft.speculative.policy import Acceptance, AdaptivePolicy, BatchPlan
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


@dataclass(eq=False)  # one generation is itself: two with the same prompt are two
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
    started: float = 0.0  # when it was started (perf_counter): its TTFT counts from here
    prefilled: int = 0  # of the prompt, the tokens its cache holds
    steps: int = 0  # the number of the next step (0: the prefill; Event.step)
    first: float | None = None  # when its first token was chosen
    drafting: bool = False  # its drafter has taken in the prompt (after the first token)
    work: "Work | None" = None  # the current step's drafts, between planning the pass and concluding it
    acceptance: Acceptance = field(default_factory=Acceptance)  # its own, per source (how a batch plans its k)
    finish: str | None = None  # why it ended (Event.finish_reason), once it has

    @property
    def cache(self) -> KVCache:
        return self.slot.cache

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class Work:
    """A step's drafting, kept from planning its pass to concluding it."""
    proposal: Proposal
    draft_s: float
    masks: object | None  # the future of the drafts' grammar masks (under a constraint)


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
        first.busy = False
        # a hybrid target's or draft's recurrent state rolls back a bounded number of positions, and on CUDA a pass
        # has at most target.rows rows (LoadedModel.rows): k stays within both
        bounds = (first.cache.max_draft, drafter.max_draft if drafter is not None else None,
                  target.rows - 1 if target.rows is not None else None)
        reach = [m for m in bounds if m is not None]
        self.max_draft = min(reach) if reach else None
        self.speculation = speculation
        self.policy = AdaptivePolicy(speculation)  # its timings describe this machine: kept across generations
        self.policy.per_round.update(drafter.per_round if drafter is not None else ())
        self.grammars = GrammarCompiler(target.tokenizer, target.config.vocab_size)
        self._masker: ThreadPoolExecutor | None = None  # computes verification masks during the target pass
        self.last = first  # the slot of the latest generation
        self.last_rows = 0  # rows of the latest pass of a sequence alone (Batch's metrics)

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
        s = self.start(prompt, params, speculation, halt, constraint, reuse)
        try:
            while s.finish is None:
                yield from self._emit(s, *self._step(s))
            yield self._final(s)
        except GeneratorExit:  # the caller stopped reading at a token: the cache is whole
            raise
        except BaseException:
            s.slot.forget()  # a pass may have stopped half way: nothing the cache holds is known
            raise
        finally:
            self.release(s)

    def start(self, prompt: list[int], params: SamplingParams, speculation: SpeculationConfig | None = None,
              halt: Halt | None = None, constraint: Constraint | None = None, reuse: bool = True) -> Sequence:
        """A sequence for prompt, in a slot of its own (generate's arguments), not yet prefilled; `release` it when
        it ends. QuickdraftError if it does not fit the context."""
        self.check_fits(len(prompt), params.max_tokens)
        slot, reused = self.slots.take(prompt, reuse)
        self.last = slot
        speculation = speculation or self.speculation
        drafter = slot.drafter if speculation.draft_max > 0 else None
        eos = self.target.tokenizer.eos_ids if params.stop_at_eos else frozenset()
        if constraint is not None:  # the output ends where the grammar allows an end and the model takes it
            eos = self.target.tokenizer.eos_ids | constraint.eos_ids
        stats = SpeculationStats(drafter=self.drafter_name if drafter else "none",
                                 draft_device=str(drafter.device) if drafter and drafter.device else None)
        s = Sequence(list(prompt), params, speculation, slot, drafter, constraint, halt or Halt(), eos,
                     sampling.Generators(params.seed), stats, Timings(prompt_n=len(prompt), cache_n=reused),
                     Detokenizer(self.target.tokenizer), list(prompt), started=time.perf_counter(), prefilled=reused)
        if params.max_tokens == 0:
            s.finish = "length"
        return s

    def release(self, s: Sequence) -> None:
        """The sequence has ended: its slot keeps the tokens of its cache (the step's tokens not yet taken in
        included) for the next prompt that begins with them, and is free again."""
        try:
            s.slot.tokens[:] = (s.tokens + s.pending)[:s.slot.cache.length]
            s.slot.checkpoint()
        finally:
            s.slot.busy = False

    # ---- the pieces of a step ---------------------------------------------------------------

    def _step(self, s: Sequence):
        """One step of a sequence alone: its whole prefill, or one plain step or speculative round."""
        if s.prefilled < len(s.prompt):
            t0 = time.perf_counter()
            feed = torch.tensor(s.prompt[s.prefilled:], device=self.target.device)
            self.last_rows = min(len(feed), self.target.chunk)
            logits = self.target.prefill(feed[None], s.cache)[0]
            s.prefilled = len(s.prompt)
            return self._conclude(s, logits, t0)
        feed = self._plan(s, self._k_alone(s))
        self.last_rows = len(feed)
        t0 = time.perf_counter()
        proposal = s.work.proposal
        if proposal.parents is not None:  # a tree: each row over its own path
            logits = self.target.forward_tree(feed, _depths(proposal), 1 + proposal.chain, s.cache)
        else:
            logits = self.target.forward(feed[None], s.cache)[0]
        return self._conclude(s, logits, t0)

    def _k_alone(self, s: Sequence) -> KFor:
        budget = self._budget(s)
        return lambda source: max(0, min(self.policy.k_for(source, s.speculation), budget))

    def _budget(self, s: Sequence) -> int:
        budget = draft_budget(s.params.max_tokens, s.generated, self.context - len(s.tokens))
        return min(budget, self.max_draft) if self.max_draft is not None else budget

    def _plan(self, s: Sequence, k_for: KFor, batched: bool = False, in_batch=None) -> torch.Tensor:
        """Draft (with k_for saying how many tokens) and return the rows of the sequence's next target pass: its
        last token, then the drafts (a tree's rows: the chain, then the alternatives). Under a constraint the drafts'
        masks are computed on another thread while the target runs (llguidance releases the GIL). batched: the
        sequence is stepped in a Batch; in_batch(source, width): the candidates its pass can take (Batch)."""
        if s.drafter is not None and not s.drafting:  # the draft takes in the prompt once the first token is out:
            self._begin_drafting(s, prefill=not batched)  # the wait for it is the target's prefill alone
        proposal, draft_s = Proposal([], "none"), 0.0
        if s.drafter is not None and self._budget(s) > 0:
            t0 = time.perf_counter()
            generator = s.generators.on(s.drafter.device or self.target.device)
            if self._trees(s, batched):  # alternatives emit no more tokens than the chain beside them could, but
                room = self.context - len(s.tokens)  # their rows must fit the cache and a row-wise pass (a batch's)

                def branches(source: str, k: int) -> int:
                    width = min(self.policy.branches(source, k, s.speculation, probe=not batched),
                                1 + max(0, min(room - k, ROWWISE_MAX - 1 - k)))
                    return in_batch(source, width) if batched and width > 1 else width

                proposal = s.drafter.propose(s.tokens, k_for, s.params, generator, None, branches)
            else:  # constrain_draft False drafts as llama.cpp does, blind to the grammar (for comparison)
                proposal = s.drafter.propose(s.tokens, k_for, s.params, generator,
                                             s.constraint if s.speculation.constrain_draft else None)
            draft_s = time.perf_counter() - t0
        masks = None
        if s.constraint is not None and proposal.tokens:
            if self._masker is None:  # its thread ends when the engine is collected (tests/test_grammar.py)
                self._masker = ThreadPoolExecutor(1, thread_name_prefix="quickdraft-mask")
            masks = self._masker.submit(s.constraint.lookahead_bitmasks, proposal.tokens)
        s.work = Work(proposal, draft_s, masks)
        return torch.tensor(s.tokens[-1:] + proposal.tokens, device=self.target.device)

    def _trees(self, s: Sequence, batched: bool) -> bool:
        """Whether this round may propose a tree (--draft-tree): its drafter able to, a target whose tree passes are
        its chain passes bit for bit (the CPU's row-wise kernels), no constraint and no log-probabilities asked for
        (both are per position of a chain). In a batch as alone (a batched pass takes a tree's rows as its own pass
        does: Transformer.forward_segments)."""
        return (s.speculation.tree > 1 and s.drafter.trees and self.target.trees
                and s.constraint is None and s.params.logprobs is None)

    def _conclude(self, s: Sequence, logits: torch.Tensor, t0: float, batched: bool = False):
        """From the logits of the sequence's pass (started at t0): the tokens it adds to s.tokens, their scores and
        their Origin; the cache rolled back to match. A prefill's first token, a plain step's or a round's."""
        if s.steps == 0:  # the prefill's last row
            s.slot.checkpoint()  # a turn boundary: the next turn of a hybrid's conversation restarts here at worst
            return (*self._choose(s, logits), _TARGET)
        work, s.work = s.work, None
        proposal, draft_s = work.proposal, work.draft_s
        if not proposal.tokens:
            chosen = self._choose(s, logits)
            seconds = time.perf_counter() - t0
            if not batched:  # a batched pass's time is the batch's (Batch: the policy's pass costs)
                self.policy.record_plain(seconds + draft_s)
            s.stats.record_plain(seconds + draft_s)
            return (*chosen, _TARGET)
        if proposal.parents is not None:
            tokens, path = self._verify_tree(s, proposal, logits)
            accepted, k = len(path) - 1, len(proposal.tokens)
            chain = sum(1 for row in path[1:] if row <= proposal.chain)  # the chain's drafts kept
            verify_s = time.perf_counter() - t0
            s.acceptance.record(proposal.source, proposal.chain, chain)
            if batched:  # the pass's time is the batch's
                self.policy.record_drafts(proposal.source, proposal.chain, chain, draft_s - proposal.catch_up_s)
            else:
                self.policy.record_round(proposal.source, proposal.chain, chain, draft_s - proposal.catch_up_s,
                                         verify_s, proposal.catch_up_s, rows=k)
            self.policy.record_tree(proposal.source, accepted - chain)
            s.stats.record_round(proposal.source, proposal.chain, accepted, len(tokens), draft_s, verify_s)
            s.stats.tree_rounds += 1  # (drafted counts the chain: its acceptance compares with chain rounds')
            s.stats.tree_alternatives_kept += accepted - chain
            return tokens, None, Origin(proposal.source, accepted, k)
        tokens, accepted, scores = self._verify(s, proposal, logits, work.masks)
        verify_s = time.perf_counter() - t0
        k = len(proposal.tokens)
        s.acceptance.record(proposal.source, k, accepted)
        if batched:
            self.policy.record_drafts(proposal.source, k, accepted, draft_s - proposal.catch_up_s)
        else:
            self.policy.record_round(proposal.source, k, accepted, draft_s - proposal.catch_up_s, verify_s,
                                     proposal.catch_up_s)
            if self._trees(s, batched):
                self.policy.record_tree(proposal.source, None)  # a chain round where a tree could have run
        s.stats.record_round(proposal.source, k, accepted, len(tokens), draft_s, verify_s)
        return tokens, scores, Origin(proposal.source, accepted, k)

    def _emit(self, s: Sequence, new_tokens: list[int], scores, origin: "Origin") -> Iterator[Event]:
        """An Event per token of the step, until the sequence ends (s.finish set: at an end-of-generation token,
        a halt, the grammar's end, or max_tokens)."""
        try:
            yield from self._tokens(s, new_tokens, scores, origin)
        finally:
            s.steps += 1

    def _tokens(self, s: Sequence, new_tokens: list[int], scores, origin: "Origin") -> Iterator[Event]:
        t = s.timings
        s.pending = list(new_tokens)
        for j, token in enumerate(new_tokens):
            now = time.perf_counter()
            if s.first is None:
                t.prefill_s = t.ttft_s = now - s.started
                s.first = now
            else:
                t.decode_s, t.n_decoded = now - s.first, t.n_decoded + 1
            if token in s.eos:
                s.finish = "stop"
                return
            s.tokens.append(s.pending.pop(0))
            if s.constraint is not None:
                s.constraint.advance(token)
            yield Event(token, s.detok.push(token), source=origin.source if j < origin.kept else "target",
                        step=s.steps, k=origin.k, **_logprobs(scores, j, token, s.params.logprobs))
            if s.halt.reason is not None:
                s.finish = s.halt.reason
            elif s.constraint is not None and s.constraint.stopped:
                s.finish = "stop"
            elif s.generated == s.params.max_tokens:
                s.finish = "length"
            if s.finish is not None:
                return

    def _final(self, s: Sequence) -> Event:
        """The last Event: why the sequence ended, the text still held back, its timings and statistics."""
        t = s.timings
        if s.first is None:  # max_tokens == 0, or halted before its first token
            t.prefill_s = t.ttft_s = time.perf_counter() - s.started
        s.stats.policy = self.policy.snapshot() if s.drafter is not None else {}
        if s.constraint is not None:
            s.stats.constraint = s.constraint.grammar.kind
            s.stats.mask_s, s.stats.masks_computed = s.constraint.seconds, s.constraint.masks_computed
        return Event(None, s.detok.flush(), finish_reason=s.finish, timings=t, stats=s.stats)

    def _begin_drafting(self, s: Sequence, prefill: bool = True) -> None:
        t0 = time.perf_counter()
        s.drafter.begin(s.prompt, prefill)
        s.drafting = True
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

    def _verify(self, s: Sequence, proposal: Proposal, logits: torch.Tensor, masks):
        """Accept from the target's logits (k + 1, V) over the last token and the drafts, and roll the cache back
        to match. Under a constraint every position is masked as a plain step there would be."""
        device, params, seq = self.target.device, s.params, s.tokens
        raw = logits
        if masks is not None:
            logits = constraints.apply(logits, constraints.unpack(masks.result().to(device), logits.shape[-1]))
        drafts = torch.tensor(proposal.tokens, device=device)
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

    def _verify_tree(self, s: Sequence, proposal: Proposal, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Accept over a tree from the target's logits (1 + N, V) at its rows: each row scored as a plain step after
        its own path would score it (the penalties' history is that path), the walk greedy, seeded or by recursive
        rejection sampling; the kept path's keys and values put in place (TreeRows.commit). Returns (the emitted
        tokens, the kept rows)."""
        device, params, seq = self.target.device, s.params, s.tokens
        paths = _paths(proposal)
        depths = _depths(proposal)

        def rows(fn):
            return torch.cat([fn(logits[r:r + 1], sampling.history(seq, params, device, appended=paths[r]))
                              for r in range(logits.shape[0])])

        if params.greedy:
            choices = rows(lambda x, h: sampling.penalize(x, params, h)).argmax(-1).tolist()
            tokens, path = accept_tree_greedy(choices, proposal.tokens, proposal.parents)
        else:
            p_rows = rows(lambda x, h: sampling.process(x, params, h))
            if params.seed is not None:  # the target's own seeded choice at each row's position
                choices = [int(sampling.gumbel_choice(p_rows[r:r + 1], params.seed, len(seq) + d)[0])
                           for r, d in enumerate(depths)]
                tokens, path = accept_tree_greedy(choices, proposal.tokens, proposal.parents)
            else:
                q_rows = proposal.q_rows(self.vocab, device).to(device)
                tokens, path = accept_tree_sampled(p_rows, q_rows, proposal.tokens, proposal.parents,
                                                   s.generators.on(device))
        TreeRows.commit(s.cache, len(seq) - 1, path)
        return tokens, path

    @staticmethod
    def _per_position(logits, history, k, fn):
        """Apply a processing step to each of the k + 1 positions with the history it would have had."""
        if history is None:
            return fn(logits, None)
        return torch.cat([fn(logits[i:i + 1], history[: history.shape[0] - k + i]) for i in range(k + 1)])


class Batch:
    """Sequences stepped together (continuous batching). A step is one target pass over the rows of every active
    sequence: a plain step's one row, a round's last token and drafts, a newcomer's next chunk of prompt (so the
    streams already running go on while it prefills). Decoding one token reads every weight; a pass of several
    sequences' rows reads them once, so on these kernels a few sequences cost little more than one. Each sequence is
    accepted and rolled back on its own, and its rows are computed as its own pass computes them
    (Transformer.forward_segments): its output is the one it gets alone, token for token.

    How much each sequence drafts is chosen for the step as a whole (speculative/policy.BatchPlan): drafts are rows
    of the same pass, and spare compute goes where it earns most tokens per second. With one sequence active a step
    is that sequence's own step (Engine._step, as generate runs it)."""

    def __init__(self, engine: Engine, parallel: int | None = None):
        self.engine = engine
        self.max_rows = engine.target.chunk  # a batched pass is row-wise: its rows in all, as a prefill chunk's
        # every decoding sequence has a row in each pass, and a newcomer's prefill one at least
        self.parallel = min(parallel or engine.slots.count, self.max_rows - 1)
        self.active: list[Sequence] = []
        self.last_rows = 0  # rows of the latest pass (0: the step ran none)

    def room(self) -> int:
        """How many more sequences may start now."""
        return max(0, min(self.parallel - len(self.active), self.engine.slots.free()))

    def add(self, prompt: list[int], params: SamplingParams, speculation: SpeculationConfig | None = None,
            halt: Halt | None = None, constraint: Constraint | None = None, reuse: bool = True) -> Sequence:
        """Start a sequence (Engine.generate's arguments): its prefill runs in the next steps. QuickdraftError if it
        does not fit the context; RuntimeError without room."""
        if self.room() == 0:
            raise RuntimeError(f"the batch runs {len(self.active)} sequences, its most")
        s = self.engine.start(prompt, params, speculation, halt, constraint, reuse)
        self.active.append(s)
        return s

    @torch.inference_mode()
    def step(self, deliver: Callable[[Sequence, Event | Exception], None]) -> None:
        """One step of every active sequence: deliver(s, event) for each of its events in order (a halt set by
        deliver ends the sequence at that token), the last one it gets being its final Event, or the exception it
        failed with. Ended sequences leave the batch, their slots kept for reuse."""
        self.last_rows = 0
        for s in list(self.active):
            if s.finish is None and s.halt.reason is not None:  # cancelled between steps: it ends now
                s.finish = s.halt.reason
            if s.finish is not None:
                self._end(s, deliver)
        if len(self.active) == 1:
            self._alone(self.active[0], deliver)
        elif self.active:
            self._together(deliver)

    def run(self, requests: list[dict]) -> list[list[Event]]:
        """Generate every request (a dict of add's arguments), each starting as soon as there is room (first come,
        first served): the events of each, in order. What a request fails with is raised."""
        out: list[list[Event]] = [[] for _ in requests]
        index: dict[int, int] = {}
        waiting = list(range(len(requests)))

        def deliver(s: Sequence, event) -> None:
            if isinstance(event, Exception):
                raise event
            out[index[id(s)]].append(event)

        try:
            while waiting or self.active:
                while waiting and self.room():
                    i = waiting.pop(0)
                    index[id(self.add(**requests[i]))] = i
                self.step(deliver)
        finally:  # a request failed: the others end here, their slots free
            for s in list(self.active):
                self.active.remove(s)
                s.slot.forget()
                self.engine.release(s)
        return out

    def _alone(self, s: Sequence, deliver) -> None:
        def step():
            out = self.engine._step(s)
            self.last_rows = self.engine.last_rows
            return out

        self._advance(s, step, deliver)

    def _advance(self, s: Sequence, conclude: Callable[[], tuple], deliver) -> None:
        """Hand over the events of the step conclude() gives the sequence; it fails alone, or ends there."""
        try:
            for event in self.engine._emit(s, *conclude()):
                deliver(s, event)
        except Exception as e:  # noqa: BLE001 -- that sequence fails, the batch goes on
            self._fail(s, e, deliver)
            return
        if s.finish is not None:
            self._end(s, deliver)

    def _together(self, deliver) -> None:
        engine = self.engine
        prefilling = [s for s in self.active if s.prefilled < len(s.prompt)]
        decoding = [s for s in self.active if s.prefilled == len(s.prompt)]
        plan = BatchPlan(engine.policy, len(decoding) + bool(prefilling), len(decoding), self.max_rows)
        feeds: dict[int, torch.Tensor] = {}
        for i, s in enumerate(decoding):
            try:
                lag = (lambda source, s=s: s.drafter.lag(s.tokens, source)) if s.drafter is not None else None
                k_for = plan.k_for(i, s.speculation, engine._budget(s), s.acceptance, lag or (lambda source: 0))
                feeds[id(s)] = engine._plan(s, k_for, batched=True,
                                            in_batch=lambda source, width, s=s: plan.branches(source, width,
                                                                                              s.speculation))
                proposal = s.work.proposal
                if proposal.parents is not None:  # the alternatives' rows: the plan counts them for the next
                    plan.extra[i] = len(proposal.tokens) - proposal.chain
            except Exception as e:  # noqa: BLE001 -- its drafter or constraint: that sequence fails
                self._fail(s, e, deliver)
        room = self.max_rows - sum(len(f) for f in feeds.values())
        for s in prefilling:  # first come, first prefilled, in the rows the decoding sequences leave
            n = min(room, len(s.prompt) - s.prefilled)
            if n <= 0:
                break
            feeds[id(s)] = torch.tensor(s.prompt[s.prefilled:s.prefilled + n], device=engine.target.device)
            room -= n
        order = [s for s in self.active if id(s) in feeds]
        if not order:
            return
        t0 = time.perf_counter()
        try:
            logits = engine.target.forward_segments([feeds[id(s)] for s in order], [s.cache for s in order],
                                                    [s in prefilling for s in order],
                                                    [_tree(s.work.proposal) if s.work is not None else None
                                                     for s in order])
        except Exception as e:  # noqa: BLE001 -- the pass failed: every sequence in it
            for s in order:
                self._fail(s, e, deliver)
            return
        rows = sum(len(feeds[id(s)]) for s in order)
        if logits[-1].is_cuda:  # the pass's time, not its launch's
            torch.cuda.synchronize(logits[-1].device)
        engine.policy.record_pass(rows, time.perf_counter() - t0)
        self.last_rows = rows
        for s, row_logits in zip(order, logits):
            if s in prefilling:
                s.prefilled += len(feeds[id(s)])
                if s.prefilled < len(s.prompt):
                    continue
            self._advance(s, lambda: engine._conclude(s, row_logits, t0, batched=True), deliver)

    def _end(self, s: Sequence, deliver) -> None:
        self.active.remove(s)
        self.engine.release(s)
        try:
            deliver(s, self.engine._final(s))
        except Exception as e:  # noqa: BLE001 -- its statistics, or handing them over: that sequence fails alone
            deliver(s, e)

    def _fail(self, s: Sequence, error: Exception, deliver) -> None:
        s.slot.forget()  # a pass may have stopped half way: nothing the cache holds is known
        s.finish = "error"
        if s in self.active:
            self.active.remove(s)
        self.engine.release(s)
        deliver(s, error)


def _tree(proposal: Proposal) -> tuple[list[int], int] | None:
    """A proposal's tree as a pass takes it (Transformer.forward_segments): its rows' depths and the chain's rows;
    None for a chain."""
    return None if proposal.parents is None else (_depths(proposal), 1 + proposal.chain)


def _depths(proposal: Proposal) -> list[int]:
    """Each row's distance from the pending token (row 0) in a tree's pass."""
    depths = [0]
    for parent in proposal.parents:
        depths.append(depths[parent + 1] + 1)
    return depths


def _paths(proposal: Proposal) -> list[list[int]]:
    """Each row's drafted tokens from the pending token's on, itself included (row 0: none)."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(proposal.tokens, proposal.parents):
        paths.append(paths[parent + 1] + [token])
    return paths


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
