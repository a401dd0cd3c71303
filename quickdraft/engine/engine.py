"""The generation loop: a step is plan -> one target pass -> conclude, over one sequence or several.

A sequence (engine/sequence.py) prefills its prompt a chunk per step, then decodes: each step either a plain step (its
last token alone) or a speculative round (its last token and the drafts its drafter proposed, verified in the same
pass: draft -> verify -> accept -> rollback). `Engine.generate` steps one sequence until it ends; `engine.Batch` steps
many, each step one pass over all their rows. Both go through `Engine.step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from quickdraft import sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.constraint import Constraint, GrammarCompiler
from quickdraft.engine import verify
from quickdraft.engine.reports import TARGET, Event, Origin, Timings, logprob_fields
from quickdraft.engine.sequence import Detokenizer, Halt, Sequence, Work
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar
from quickdraft.models.transformer import ROWWISE_MAX
from quickdraft.runtime import heap
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import MIN_REUSE, Slot, Slots, common_prefix
from quickdraft.speculative.base import Drafter, KFor, Proposal
from quickdraft.speculative.policy import HORIZON, AdaptivePolicy, BatchPlan
from quickdraft.speculative.stats import SpeculationStats

if TYPE_CHECKING:  # the engine runs whatever model it is given; it does not load one
    from quickdraft.weights.loader import LoadedModel

# What a step hands over for a sequence: an Event, or the exception the sequence failed with (its last)
Item = Event | Exception
STARVED = 4  # a prompt passed over this many steps in a row is prefilled before shorter ones


def draft_budget(max_tokens: int, generated: int, room: int) -> int:
    """Most tokens a round may draft: one fewer than the tokens still to generate (the round's last token is the
    target's), and no more than the cache has room for. tune's replay follows the same rule."""
    return min(max_tokens - generated - 1, room)


@dataclass
class Pass:
    """One step's target pass, as planned: its sequences in order, each with its rows (a decoding sequence's last
    token and drafts, or a prefilling one's next chunk of prompt)."""

    sequences: list[Sequence]
    feeds: list[torch.Tensor]
    prefill: list[bool]  # per sequence: its rows are a chunk of its prompt
    alone: bool  # the step holds one sequence: its k and timings are its own (the policy's rules for one sequence)
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
        self.max_rows = target.chunk  # a pass is row-wise: its rows in all, as a prefill chunk's
        self.speculation = speculation
        self.policy = AdaptivePolicy(speculation)  # its timings describe this machine: kept across generations
        self.policy.per_round.update(drafter.per_round if drafter is not None else ())
        self.grammars = GrammarCompiler(target.tokenizer, target.config.vocab_size)
        self._masker: ThreadPoolExecutor | None = None  # computes verification masks during the target pass
        self.last = first  # the slot of the latest generation
        self.last_rows = 0  # rows of the latest step's pass (0: it ran none)
        self.drafting = 0  # sequences running that have begun drafting (their texts are what the policy measures)

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
              wanted: Iterable[list[int]] = ()) -> Sequence:
        """A sequence for prompt, in a slot of its own (generate's arguments), not yet prefilled: `step` it until it
        ends (it is then released), or `release` it. wanted: the prompts of requests waiting their turn, whose kept
        slots this one leaves alone where it can (Slots.take). QuickdraftError if the prompt fills the context;
        max_tokens beyond it are capped to the room left (the generation then ends with "length" there, as OpenAI's
        and llama-server's do)."""
        self.check_fits(len(prompt))
        if len(prompt) + params.max_tokens > self.context:
            params = dataclasses.replace(params, max_tokens=self.context - len(prompt))
        slot, reused = self.slots.take(prompt, reuse, wanted)
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
            if s.drafting and not s.ended:
                self.drafting -= 1
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
        """Each sequence's rows for one pass: a decoding sequence's last token and what its drafter proposes (how many
        by the policy: a sequence's own rule alone, the step's plan beside others, speculative/policy.BatchPlan),
        then the prefilling ones' next chunks of prompt in the rows left: the shortest prompt first (a short request
        behind a long one gets its first token after a step or two), and beside decoding sequences no more rows than
        keep their steps at least half as fast as without (policy.prefill_rows, from measured pass costs). A sequence
        whose drafting fails (its drafter, its constraint) is failed and left out of the pass."""
        alone = len(sequences) == 1
        decoding = [s for s in sequences if not s.prefilling]
        prefilling = [s for s in sequences if s.prefilling]
        batchable = self.drafter is not None and self.drafter.batchable
        shared = frozenset(self.drafter.sources) if batchable else frozenset()
        batch = None if alone else BatchPlan(self.policy, len(decoding) + bool(prefilling), len(decoding),
                                             self.max_rows, shared)
        feeds: dict[Sequence, torch.Tensor] = {}
        failed = []
        drafting: dict[Sequence, tuple] = {}  # batched: each sequence's round as it drafts, its passes run as one
        for i, s in enumerate(decoding):
            try:
                self.policy.position = len(s.tokens)  # the length its choice (alone: and timings) is for
                if batch is not None and shared and s.drafter is not None:
                    drafting[s] = self._rows_begin(s, i, batch)
                else:
                    feeds[s] = self._rows(s, i, batch)
            except Exception as e:  # noqa: BLE001 -- its drafter or constraint: that sequence fails
                failed.append((s, self.fail(s, e)))
        if drafting:
            self._draft_together(drafting, feeds, failed, batch)
        taken = sum(len(f) for f in feeds.values())
        room = self.max_rows - taken
        if feeds:  # beside decoding sequences: the prefill's share of the pass
            room = min(room, self.policy.prefill_rows(taken, self.max_rows))
        # the shortest first, but a prompt passed over STARVED steps in a row before any (short prompts arriving
        # every step would hold a long one back for ever)
        sharing = set()  # waiting for a beginning another sequence prefills now (not passed over: no STARVED count)
        for s in sorted(prefilling, key=lambda s: (s.waited < STARVED, len(s.prompt) - s.prefilled)):
            if self._shares(s, sequences, feeds):
                sharing.add(s)
                continue
            n = min(room, len(s.prompt) - s.prefilled)
            if n <= 0:
                break
            feeds[s] = torch.tensor(s.prompt[s.prefilled:s.prefilled + n], device=self.target.device)
            room -= n
        for s in prefilling:
            s.waited = 0 if s in feeds or s in sharing else s.waited + 1
        order = [s for s in sequences if s in feeds]
        return Pass(order, [feeds[s] for s in order], [s.prefilling for s in order], alone, failed)

    def _shares(self, s: Sequence, sequences: list[Sequence], feeds: dict) -> bool:
        """Before a prefilling sequence takes rows: a beginning of its prompt that another sequence running now has in
        its cache already (agents or chats under one system prompt, arriving together: none had it in a kept slot when
        they were started) is copied from there (Slot.copy_prefix: keys and values, the drafter's share) rather than
        computed again, bit for bit what its own prefill would write. True where it should wait a step instead: a
        sequence ahead of it in this pass is prefilling that beginning now. Not for recurrent states (a running
        sequence keeps none at the common prefix)."""
        if s.slot.cache.recurrent:
            return False
        shared = [(o, c) for o in sequences if o is not s and not o.ended
                  for c in [min(common_prefix(s.prompt, o.prompt), len(s.prompt) - 1)] if c >= s.prefilled + MIN_REUSE]
        best, have = None, s.prefilled
        for o, common in shared:
            if min(o.prefilled, common) > have:
                best, have = o, min(o.prefilled, common)
        if best is not None and have >= s.prefilled + MIN_REUSE and s.slot.copy_prefix(best.slot, have):
            s.slot.tokens[:] = s.prompt[:have]  # (a running slot's own list is written when its sequence ends)
            s.timings.cache_n += have - s.prefilled
            s.prefilled = have
        # more of it to come from one prefilling it in this pass
        return any(o in feeds and o.prefilled < common and common >= s.prefilled + MIN_REUSE for o, common in shared)

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
        self.policy.record_pass(p.rows, time.perf_counter() - p.t0)
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

    # ---- planning ----------------------------------------------------------------------------------

    def _rows(self, s: Sequence, index: int, batch: BatchPlan | None) -> torch.Tensor:
        """A decoding sequence's rows: its last token, then the drafts (a tree's rows: the chain, then the
        alternatives). batch: the step's plan where the sequence is stepped beside others (index: its place there)."""
        if batch is None:
            return self._propose(s, self._k_alone(s))
        feed = self._propose(s, *self._in_batch(s, index, batch))
        self._count_alternatives(s, index, batch)
        return feed

    def _in_batch(self, s: Sequence, index: int, batch: BatchPlan) -> tuple:
        """A batched sequence's k_for (its k chosen in the step's plan) and the candidates its tree may have."""
        k_for = batch.k_for(index, s.speculation, self._budget(s), s.acceptance, self._lag(s), self._horizon(s))
        return k_for, lambda source, width: batch.branches(source, width, s.speculation)

    @staticmethod
    def _count_alternatives(s: Sequence, index: int, batch: BatchPlan) -> None:
        """A tree's alternatives' rows: the plan counts them for the next sequences."""
        proposal = s.work.proposal
        if proposal.parents is not None:
            batch.extra[index] = len(proposal.tokens) - proposal.chain

    def _rows_begin(self, s: Sequence, index: int, batch: BatchPlan) -> tuple:
        """A decoding sequence's round in a batch whose draft passes run as one (_draft_together): its k chosen in
        the step's plan now (in order, as _rows does), its drafting begun up to its first pass. Returns (the round's
        steps, its start, the feed of its next pass or None, the proposal once done)."""
        args = self._proposal_args(s, *self._in_batch(s, index, batch))
        if args is None:
            return None, 0.0, None, Proposal([], "none")
        t0 = time.perf_counter()
        steps = s.drafter.propose_steps(*args)
        try:
            return steps, t0, next(steps), None
        except StopIteration as done:
            return steps, t0, None, done.value

    def _draft_together(self, drafting: dict, feeds: dict, failed: list, batch: BatchPlan) -> None:
        """Run the batched sequences' rounds in step: each pass of every sequence still drafting as one pass of the
        draft model (its rows read the weights once), until every round is done; then their rows, as _rows gives
        them. A sequence whose drafting fails is failed and left out."""
        index = {s: i for i, s in enumerate(drafting)}
        while True:
            waiting = [s for s, (_, _, feed, done) in drafting.items() if done is None and feed is not None]
            if not waiting:
                break
            try:
                logits = waiting[0].drafter.batched_pass([s.drafter for s in waiting],
                                                         [drafting[s][2] for s in waiting])
            except Exception as e:  # noqa: BLE001 -- the shared pass: every sequence in it fails
                for s in waiting:
                    failed.append((s, self.fail(s, e)))
                    drafting.pop(s)
                continue
            for s, row in zip(waiting, logits):
                steps, t0, _, _ = drafting[s]
                try:
                    drafting[s] = (steps, t0, steps.send(row), None)
                except StopIteration as done:
                    drafting[s] = (steps, t0, None, done.value)
                except Exception as e:  # noqa: BLE001 -- its drafter or constraint: that sequence fails
                    failed.append((s, self.fail(s, e)))
                    drafting.pop(s)
        for s, (steps, t0, _, proposal) in drafting.items():
            try:
                feeds[s] = self._rows_end(s, proposal, time.perf_counter() - t0 if steps is not None else 0.0)
                self._count_alternatives(s, index[s], batch)
            except Exception as e:  # noqa: BLE001
                failed.append((s, self.fail(s, e)))

    def _k_alone(self, s: Sequence) -> KFor:
        budget, lag, horizon = self._budget(s), self._lag(s), self._horizon(s)
        return lambda source: max(0, min(self.policy.k_for(source, s.speculation, lag(source), horizon), budget))

    @staticmethod
    def _lag(s: Sequence):
        """Per source, the tokens of the sequence its drafter would first have to take in."""
        return (lambda source: s.drafter.lag(s.tokens, source)) if s.drafter is not None else (lambda source: 0)

    @staticmethod
    def _horizon(s: Sequence) -> int:
        """The tokens still to come, as far as a drafter's catch-up must pay back (policy.HORIZON): at most what is
        left of max_tokens, at least the answer's length so far."""
        return min(s.params.max_tokens - s.generated, max(HORIZON, s.generated))

    def _budget(self, s: Sequence) -> int:
        budget = draft_budget(s.params.max_tokens, s.generated, self.context - len(s.tokens))
        return min(budget, self.max_draft) if self.max_draft is not None else budget

    def _propose(self, s: Sequence, k_for: KFor, in_batch=None) -> torch.Tensor:
        """Draft (with k_for saying how many tokens) and return the sequence's rows. Under a constraint the drafts'
        masks are computed on another thread while the target runs (llguidance releases the GIL). in_batch(source,
        width): the candidates a tree may have in the step's pass (None: the sequence is alone)."""
        args = self._proposal_args(s, k_for, in_batch)
        if args is None:
            return self._rows_end(s, Proposal([], "none"), 0.0)
        t0 = time.perf_counter()
        proposal = s.drafter.propose(*args)
        return self._rows_end(s, proposal, time.perf_counter() - t0)

    def _proposal_args(self, s: Sequence, k_for: KFor, in_batch=None) -> tuple | None:
        """The arguments of the round's propose (or propose_steps): the sequence, k_for, its sampling, generator and
        constraint, and where a tree may be proposed its branches; None where the sequence drafts nothing."""
        batched = in_batch is not None
        if s.drafter is not None and not s.drafting:  # once the first token is out; what the drafter lacks of the
            self._begin_drafting(s)  # prompt it takes in when it first drafts, where the policy finds that it pays
        if s.drafter is None or self._budget(s) <= 0:
            return None
        generator = s.generators.on(s.drafter.device or self.target.device)
        if self._trees(s):  # alternatives emit no more tokens than the chain beside them could, but their rows
            room = self.context - len(s.tokens)  # must fit the cache and a row-wise pass (a batch's)

            def branches(source: str, k: int) -> int:
                width = min(self.policy.branches(source, k, s.speculation, probe=not batched),
                            1 + max(0, min(room - k, ROWWISE_MAX - 1 - k)))
                return in_batch(source, width) if batched and width > 1 else width

            return s.tokens, k_for, s.params, generator, None, branches
        # constrain_draft False drafts as llama.cpp does, blind to the grammar (for comparison)
        return s.tokens, k_for, s.params, generator, s.constraint if s.speculation.constrain_draft else None

    def _rows_end(self, s: Sequence, proposal: Proposal, draft_s: float) -> torch.Tensor:
        """The round's work (the proposal, its drafting's seconds, a constraint's masks computed meanwhile) and the
        sequence's rows: its last token, then the proposal's."""
        masks = None
        if s.constraint is not None and proposal.tokens:
            if self._masker is None:  # its thread ends when the engine is collected (tests/test_grammar.py)
                self._masker = ThreadPoolExecutor(1, thread_name_prefix="quickdraft-mask")
            masks = self._masker.submit(s.constraint.lookahead_bitmasks, proposal.tokens)
        s.work = Work(proposal, draft_s, masks)
        return torch.tensor(s.tokens[-1:] + proposal.tokens, device=self.target.device)

    def _trees(self, s: Sequence) -> bool:
        """Whether this round may propose a tree (--draft-tree): its drafter able to, a target whose tree passes are
        its chain passes bit for bit (the CPU's row-wise kernels), no constraint and no log-probabilities asked for
        (both are per position of a chain). In a batch as alone (a batched pass takes a tree's rows as its own pass
        does: Transformer.forward_segments)."""
        return (s.speculation.tree > 1 and s.drafter.trees and self.target.trees
                and s.constraint is None and s.params.logprobs is None)

    def _tree_note(self, s: Sequence) -> str:
        """Why a sequence that asked for trees verified none."""
        if not s.drafter.trees:
            return f"{self.drafter_name} offers no candidates beside its chain: chains only"
        if not self.target.trees:
            return "trees are verified on the CPU only (a GPU pass's shape decides its arithmetic): chains only"
        if s.constraint is not None or s.params.logprobs is not None:
            return "a grammar or log-probabilities are per position of a chain: chains only"
        choices = [c for source, c in self.policy.tree_choice.items() if source in s.drafter.sources]
        if not choices:
            return "no round drafted a chain to put candidates beside"
        width, k, tree, chain = choices[-1]
        return (f"declined by measurement: a tree of {width} beside {k} drafts predicted {tree:.1f} tokens/s, the "
                f"chain alone {chain:.1f}")

    def _begin_drafting(self, s: Sequence) -> None:
        """The sequence's drafter takes its prompt; a new text begins for the policy (its acceptance so far decayed
        to a prior) unless others are drafting beside it, whose rounds the counts describe (several requests starting
        together decayed them once each: to nothing, so that a batch never found drafting worth it)."""
        s.drafter.begin(s.prompt, prefill=False)
        s.drafting = True
        if self.drafting == 0:
            self.policy.begin()
        self.drafting += 1

    # ---- concluding ---------------------------------------------------------------------------------

    def _conclude(self, s: Sequence, logits: torch.Tensor, p: Pass):
        """From the logits of the sequence's pass: the tokens it adds to s.tokens, their scores and their Origin; the
        cache rolled back to match. A prefill's first token, a plain step's or a round's. A round's timings are the
        policy's where the sequence had the step alone (a batched pass's time is the batch's: Engine.run)."""
        if s.steps == 0:  # the prefill's last row
            s.slot.checkpoint()  # a turn boundary: the next turn of a hybrid's conversation restarts here at worst
            return (*verify.choose(s, logits), TARGET)
        work, s.work = s.work, None
        proposal, draft_s = work.proposal, work.draft_s
        if not proposal.tokens:
            chosen = verify.choose(s, logits)
            seconds = time.perf_counter() - p.t0
            if p.alone:
                self.policy.record_plain(seconds + draft_s)
            s.stats.record_plain(seconds + draft_s)
            return (*chosen, TARGET)
        drafting_s = draft_s - proposal.catch_up_s
        s.timings.draft_prefill_s += proposal.catch_up_s
        first = s.stats.sources[proposal.source] == 0  # its first round in this generation: a start
        catch_up_s = self.policy.record_catch_up(proposal.source, proposal.caught_up, proposal.catch_up_s, first)
        if proposal.parents is not None:
            tokens, path = verify.tree(s, proposal, logits, self.vocab)
            accepted, k = len(path) - 1, len(proposal.tokens)
            chain = sum(1 for row in path[1:] if row <= proposal.chain)  # the chain's drafts kept
            verify_s = time.perf_counter() - p.t0
            s.acceptance.record(proposal.source, proposal.chain, chain)
            if p.alone:
                self.policy.record_round(proposal.source, proposal.chain, chain, drafting_s, verify_s,
                                         catch_up_s, rows=k)
            else:
                self.policy.record_drafts(proposal.source, proposal.chain, chain, drafting_s)
            self.policy.record_tree(proposal.source, accepted - chain)
            s.stats.record_round(proposal.source, proposal.chain, accepted, len(tokens), draft_s, verify_s)
            s.stats.tree_rounds += 1  # (drafted counts the chain: its acceptance compares with chain rounds')
            s.stats.tree_alternatives_kept += accepted - chain
            return tokens, None, Origin(proposal.source, accepted, k)
        tokens, accepted, scores = verify.chain(s, proposal, logits, work.masks, self.vocab)
        verify_s = time.perf_counter() - p.t0
        k = len(proposal.tokens)
        s.acceptance.record(proposal.source, k, accepted)
        if p.alone:
            self.policy.record_round(proposal.source, k, accepted, drafting_s, verify_s, catch_up_s)
            if self._trees(s):
                self.policy.record_tree(proposal.source, None)  # a chain round where a tree could have run
        else:
            self.policy.record_drafts(proposal.source, k, accepted, drafting_s)
        s.stats.record_round(proposal.source, k, accepted, len(tokens), draft_s, verify_s)
        return tokens, scores, Origin(proposal.source, accepted, k)

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
            s.stats.tree_note = self._tree_note(s)
        if s.constraint is not None:
            s.stats.constraint = s.constraint.grammar.kind
            s.stats.mask_s, s.stats.masks_computed = s.constraint.seconds, s.constraint.masks_computed
        return Event(None, s.detok.flush(), finish_reason=s.finish, timings=t, stats=s.stats)
