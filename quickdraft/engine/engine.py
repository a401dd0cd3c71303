"""The generation loop: a step is schedule -> one target pass -> conclude, over one sequence or several.

A sequence (engine/sequence.py) prefills its prompt a chunk per step, then decodes: each step either a plain step (its
last token alone) or a speculative round (its last token and the drafts its drafter proposed, verified in the same
pass: engine/round.py). The scheduler (engine/scheduler.py) decides which prompts prefill how many rows. One sequence
is a step of one: `Engine.generate` steps one sequence until it ends; `engine.Batch` steps many, each step one pass
over all their rows. Both go through `Engine.step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from quickdraft import sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.constraint import Constraint, GrammarCompiler
from quickdraft.engine import verify
from quickdraft.engine.reports import TARGET, Event, Origin, Timings, logprob_fields
from quickdraft.engine.round import Rounds
from quickdraft.engine.scheduler import Scheduler
from quickdraft.engine.sequence import Detokenizer, Halt, Sequence
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar
from quickdraft.runtime import heap
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import KEPT_MAX, HostCopies, Slot, Slots
from quickdraft.speculative.base import Drafter
from quickdraft.speculative.policy import Acceptance, AdaptivePolicy, Prior, StepPlan
from quickdraft.speculative.stats import SpeculationStats

if TYPE_CHECKING:  # the engine runs whatever model it is given; it does not load one
    from quickdraft.weights.loader import LoadedModel

# What a step hands over for a sequence: an Event, or the exception the sequence failed with (its last)
Item = Event | Exception


@dataclass
class Pass:
    """One step's target pass, as planned: its sequences in order, each with its rows (a decoding sequence's last
    token and drafts, or a prefilling one's next chunk of prompt)."""

    sequences: list[Sequence]
    feeds: list[torch.Tensor]
    prefill: list[bool]  # per sequence: its rows are a chunk of its prompt
    plan: StepPlan  # the policy's choices for the step, and where its rounds are recorded
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # sequences whose planning failed
    t0: float = 0.0  # when the pass began

    @property
    def rows(self) -> int:
        return sum(len(f) for f in self.feeds)


class Engine:
    """Generates from a target model, speculatively when given a drafter.

    A sequence's cache (its slot's: runtime/slots.py) always holds every token of it but the last, which is the input
    of the next target pass (a plain step feeds it alone; a round feeds it with the drafts). Slots outlive their
    generations: a prompt that begins with tokens a slot holds prefills only the rest (`reuse`), with the same output
    as from an empty cache.
    """

    def __init__(self, target: LoadedModel, context: int | None = None, drafter: Drafter | None = None,
                 speculation: SpeculationConfig = SpeculationConfig(), slots: int = 1, prior: Prior | None = None,
                 cache_ram: int | None = None):
        """slots: how many sequences to keep for reuse (each a KV cache of `context` positions, and its drafter's);
        prior: what passes cost on this machine before any is timed (the policy's starting prices: api.prior);
        cache_ram: bytes for the kept sequences. Where caches take memory as they fill (the CPU) it bounds them, as
        many kept as fit (up to KEPT_MAX); where they are whole (a card, its slots fitted by the memory plan) the
        sequences the slots give up are copied to this much host memory and back (runtime/slots.HostCopies)."""
        self.target = target
        self.capacity = context or target.model.max_context
        self.drafter = drafter  # speaks for the first slot; each further slot drafts with a fork of it
        self.slots = Slots(self._slot, slots)
        first, _ = self.slots.take([], reuse=False)  # made now: its cache is the one tools ask for before generating
        first.busy = False
        if cache_ram is not None and first.cache.lazy:
            self.slots.count, self.slots.budget = max(slots, KEPT_MAX), cache_ram
        elif cache_ram is not None:
            self.slots.host = HostCopies(cache_ram)
        # a hybrid target's or draft's recurrent state rolls back a bounded number of positions, and on CUDA a pass
        # has at most target.rows rows (LoadedModel.rows): k stays within both
        bounds = (first.cache.max_draft, drafter.max_draft if drafter is not None else None,
                  target.rows - 1 if target.rows is not None else None)
        reach = [m for m in bounds if m is not None]
        self.max_draft = min(reach) if reach else None
        self.max_rows = target.chunk  # a pass is row-wise: its rows in all, as a prefill chunk's
        self.speculation = speculation
        self.policy = AdaptivePolicy(speculation, prior)  # its timings describe this machine: kept across generations
        self.policy.per_round.update(drafter.per_round if drafter is not None else ())
        self.grammars = GrammarCompiler(target.tokenizer, target.config.vocab_size)
        self.scheduler = Scheduler(self.max_rows, self.policy)
        self.rounds = Rounds(self)
        self.last = first  # the slot of the latest generation
        self.last_rows = 0  # rows of the latest step's pass (0: it ran none)

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

    def check_fits(self, prompt_n: int) -> None:
        """A prompt must leave room in the context for a token (QuickdraftError naming the fix)."""
        if prompt_n == 0:
            raise QuickdraftError("{prompt} is empty: give some text", "prompt")
        if prompt_n >= self.context:
            most = self.target.config.max_context
            raise QuickdraftError(
                f"the prompt ({prompt_n} tokens) fills the context of {self.context} tokens: shorten it"
                + (f", or raise {{context}} (the model takes up to {most})" if most > self.context else ""), "context")

    def constraint(self, grammar: Grammar | None) -> Constraint | None:
        """A matcher for one generation (QuickdraftError, with the library's message, if the grammar is invalid)."""
        return self.grammars.constraint(grammar) if grammar is not None else None

    # ---- one sequence ------------------------------------------------------------------------------

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
            while not s.ended:
                with contextlib.closing(self.step([s])) as items:
                    for _, item in items:
                        if isinstance(item, Exception):
                            raise item
                        yield item
        except GeneratorExit:  # the caller stopped reading at a token: the cache is whole
            raise
        except BaseException:
            if not s.ended:  # a pass may have stopped half way: nothing the cache holds is known
                s.slot.forget()
            raise
        finally:
            if not s.ended:
                self.release(s)

    def start(self, prompt: list[int], params: SamplingParams, speculation: SpeculationConfig | None = None,
              halt: Halt | None = None, constraint: Constraint | None = None, reuse: bool = True,
              wanted: Iterable[list[int]] = (), scope=None) -> Sequence:
        """A sequence for prompt, in a slot of its own (generate's arguments), not yet prefilled: `step` it until it
        ends (it is then released), or `release` it. wanted: the prompts of requests waiting their turn, whose kept
        slots this one leaves alone where it can (Slots.take); scope: whose generation it is (a client: what it may
        draft from of what was answered before, and what it adds to: Drafter.scoped). QuickdraftError if the prompt fills the context;
        max_tokens beyond it are capped to the room left (the generation then ends with "length" there, as OpenAI's
        and llama-server's do)."""
        self.check_fits(len(prompt))
        if len(prompt) + params.max_tokens > self.context:
            params = dataclasses.replace(params, max_tokens=self.context - len(prompt))
        slot, reused = self.slots.take(prompt, reuse, wanted)
        self.last = slot
        if slot.drafter is not None:
            slot.drafter.scoped(scope)
        speculation = speculation or self.speculation
        drafter = slot.drafter if speculation.draft_max > 0 else None
        eos = self.target.tokenizer.eos_ids if params.stop_at_eos else frozenset()
        if constraint is not None:  # the output ends where the grammar allows an end and the model takes it
            eos = self.target.tokenizer.eos_ids | constraint.eos_ids
        stats = SpeculationStats(drafter=self.drafter_name if drafter else "none",
                                 draft_device=str(drafter.device) if drafter and drafter.device else None)
        if not reused or slot.acceptance is None:  # a new conversation: its own acceptance is to be learned
            slot.acceptance = Acceptance()
        s = Sequence(list(prompt), params, speculation, slot, drafter, constraint, halt or Halt(), eos,
                     sampling.Generators(params.seed), stats, Timings(prompt_n=len(prompt), cache_n=reused),
                     Detokenizer(self.target.tokenizer), list(prompt), started=time.perf_counter(), prefilled=reused,
                     acceptance=slot.acceptance)
        if params.max_tokens == 0:
            s.finish = "length"
        return s

    def release(self, s: Sequence) -> None:
        """The sequence has ended: its slot keeps the tokens of its cache (the step's tokens not yet taken in
        included) for the next prompt that begins with them, and is free again."""
        try:
            s.slot.tokens[:] = (s.tokens + s.pending)[:s.slot.cache.length]
            s.slot.checkpoint()
            if s.slot.drafter is not None and s.finish not in (None, "error", "cancelled"):
                s.slot.drafter.finish(s.tokens, len(s.prompt))  # (what it learns from an answer: its history)
        finally:
            s.slot.busy = False
            if not s.ended:
                self.rounds.ended(s)
            s.ended = True
            heap.trim()  # what its passes freed goes back to the system (runtime/heap.py)

    def fail(self, s: Sequence, error: Exception) -> Exception:
        """End the sequence with an error (its slot forgets what it held: a pass may have stopped half way);
        returns the error."""
        s.slot.forget()
        s.finish = "error"
        self.release(s)
        return error

    # ---- a step --------------------------------------------------------------------------------------

    def step(self, sequences: list[Sequence]) -> Iterator[tuple[Sequence, Item]]:
        """One step of the sequences: (sequence, item) for each of a sequence's events in order, its last item being
        its final Event or the exception it failed with (it is released then). A sequence halted between steps ends
        first; the others share one target pass (plan, run, conclude). A halt set while a sequence's events are
        handed over ends it at that token; a sequence ended meanwhile (`fail`) gets nothing more."""
        self.last_rows = 0
        live = []
        for s in sequences:
            if s.ended:
                continue
            if s.finish is None and s.halt.reason is not None:  # cancelled between steps: it ends now
                s.finish = s.halt.reason
            if s.finish is not None:
                yield s, self.end(s)
            else:
                live.append(s)
        if not live:
            return
        p = self.plan(live)
        yield from p.failed
        if not p.sequences:
            return
        try:
            logits = self.run(p)
        except Exception as e:  # noqa: BLE001 -- the pass failed: every sequence in it
            for s in p.sequences:
                yield s, self.fail(s, e)
            return
        yield from self.conclude(p, logits)
        self.slots.fit()  # the pass's new positions within --cache-ram: idle conversations dropped as running ones grow

    def plan(self, sequences: list[Sequence]) -> Pass:
        """Each sequence's rows for one pass: a decoding sequence's last token and what its drafter proposes (its
        round: engine/round.py, k chosen for the step as a whole by the policy), then the prefilling ones' next chunks
        of prompt in the rows left (the scheduler's choice). A sequence whose drafting fails (its drafter, its
        constraint) is failed and left out of the pass."""
        decoding = [s for s in sequences if not s.prefilling]
        prefilling = [s for s in sequences if s.prefilling]
        shared = frozenset(self.drafter.sources) if self.drafter is not None and self.drafter.batchable else frozenset()
        plan = self.policy.step(len(decoding), bool(prefilling), self.max_rows, shared)
        failed = []

        def fail(s: Sequence, error: Exception) -> None:
            failed.append((s, self.fail(s, error)))

        rounds = []
        for i, s in enumerate(decoding):
            try:
                rounds.append(self.rounds.begin(s, i, plan))
            except Exception as e:  # noqa: BLE001 -- its drafter or constraint: that sequence fails
                fail(s, e)
        feeds = self.rounds.propose(rounds, plan, fail)
        prefills = self.scheduler.prefills(prefilling, sequences, sum(len(f) for f in feeds.values()), self._copy)
        for s, n in prefills.rows.items():
            feeds[s] = torch.tensor(s.prompt[s.prefilled:s.prefilled + n], device=self.target.device)
        order = [s for s in sequences if s in feeds]
        return Pass(order, [feeds[s] for s in order], [s.prefilling for s in order], plan, failed)

    @staticmethod
    def _copy(s: Sequence, other: Sequence, n: int) -> bool:
        """The scheduler's shared beginning: s takes other's first n prompt tokens from its slot (Slot.copy_prefix:
        keys and values, the drafter's share), bit for bit what its own prefill would write. False where it cannot."""
        if not s.slot.copy_prefix(other.slot, n):
            return False
        s.slot.tokens[:] = s.prompt[:n]  # (a running slot's own list is written when its sequence ends)
        s.timings.cache_n += n - s.prefilled
        s.prefilled = n
        return True

    def run(self, p: Pass) -> list[torch.Tensor]:
        """The pass: per sequence the logits of its rows (a prompt chunk's last row alone). A sequence alone runs its
        own kind of pass (a prefill chunk, a plain step or chain, a tree); several run as one batched pass whose rows
        are each computed as its sequence's own pass computes them (Transformer.forward_segments)."""
        p.t0 = time.perf_counter()
        self.last_rows = p.rows
        if len(p.sequences) == 1:
            s, feed = p.sequences[0], p.feeds[0]
            proposal = s.work.proposal if s.work is not None else None
            if p.prefill[0]:
                return [self.target.forward(feed[None], s.cache, last_only=True)[0]]
            if proposal is not None and proposal.parents is not None:  # a tree: each row over its own path
                return [self.target.forward_tree(feed, verify.tree_depths(proposal), 1 + proposal.chain, s.cache)]
            return [self.target.forward(feed[None], s.cache)[0]]
        logits = self.target.forward_segments(p.feeds, [s.cache for s in p.sequences], p.prefill,
                                              [verify.tree_shape(s.work.proposal) if s.work is not None else None
                                               for s in p.sequences])
        if logits[-1].is_cuda:  # the pass's time, not its launch's
            torch.cuda.synchronize(logits[-1].device)
        p.plan.record_pass(p.rows, time.perf_counter() - p.t0, len(p.sequences))
        return logits

    def conclude(self, p: Pass, logits: list[torch.Tensor]) -> Iterator[tuple[Sequence, Item]]:
        """What the pass gives each sequence: the tokens it emits (a prefill's first token, a plain step's, or a
        round's accepted drafts and the target's next), each handed over as it is taken; its final Event where it
        ends. A prefilling sequence whose prompt is not all in yet gets nothing."""
        for s, feed, prefill, row_logits in zip(p.sequences, p.feeds, p.prefill, logits):
            if s.ended:
                continue
            if prefill:
                s.prefilled += len(feed)
                if s.prefilling:
                    continue
            try:
                yield from self._emit(s, *self._conclude(s, row_logits, p))
            except Exception as e:  # noqa: BLE001 -- its verification or constraint: that sequence fails alone
                if not s.ended:
                    yield s, self.fail(s, e)
                continue
            if s.finish is not None and not s.ended:
                yield s, self.end(s)

    def end(self, s: Sequence) -> Item:
        """The sequence's final Event (or what making it failed with); it is released."""
        try:
            return self._final(s)
        except Exception as e:  # noqa: BLE001 -- its statistics: that sequence fails alone
            return e
        finally:
            self.release(s)

    # ---- concluding ---------------------------------------------------------------------------------

    def _conclude(self, s: Sequence, logits: torch.Tensor, p: Pass):
        """From the logits of the sequence's pass: the tokens it adds to s.tokens, their scores and their Origin; the
        cache rolled back to match. A prefill's first token, or a round's (engine/round.py: a plain step is one)."""
        if s.steps == 0:  # the prefill's last row
            s.slot.checkpoint()  # a turn boundary: the next turn of a hybrid's conversation restarts here at worst
            return (*verify.choose(s, logits), TARGET)
        return self.rounds.conclude(s, logits, p.plan, p.t0)

    def _emit(self, s: Sequence, new_tokens: list[int], scores, origin: Origin) -> Iterator[tuple[Sequence, Event]]:
        """An Event per token of the step, until the sequence ends (s.finish set: at an end-of-generation token,
        a halt, the grammar's end, or max_tokens)."""
        try:
            yield from self._tokens(s, new_tokens, scores, origin)
        finally:
            s.steps += 1

    def _tokens(self, s: Sequence, new_tokens: list[int], scores, origin: Origin) -> Iterator[tuple[Sequence, Event]]:
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
            yield s, Event(token, s.detok.push(token), source=origin.source if j < origin.kept else "target",
                           step=s.steps, k=origin.k, **logprob_fields(scores, j, token, s.params.logprobs))
            if s.ended:  # failed while its event was handed over
                return
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
        if s.speculation.tree > 1 and s.drafter is not None and not s.stats.tree_rounds:
            s.stats.tree_note = self.rounds.tree_note(s)
        if s.constraint is not None:
            s.stats.constraint = s.constraint.grammar.kind
            s.stats.mask_s, s.stats.masks_computed = s.constraint.seconds, s.constraint.masks_computed
        return Event(None, s.detok.flush(), finish_reason=s.finish, timings=t, stats=s.stats)
