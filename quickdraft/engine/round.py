"""One sequence's speculative round, in the order it runs:

    k       = plan.k_for(...)                  how many to draft, per source (the policy, for the whole step)
    drafts  = drafter.propose(seq, k, ...)     the drafter's proposal (its passes beside other sequences' where
                                               its kind allows: `propose`)
    rows    = [last token] + drafts            the sequence's rows of the step's target pass (engine.Engine.run)
    tokens  = verify.chain(...) / .tree(...)   exact acceptance from the target's logits; the cache rolled back
    plan.record_round(...)                     what the round cost and kept, for the next choice

`begin` and `propose` run the first half for every decoding sequence of a step, `conclude` the second once the pass
has run. A plain step is a round of k = 0. One sequence is a step of one: the same code, its plan the policy's rules
for a sequence alone (speculative/policy.StepPlan).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from quickdraft.engine import verify
from quickdraft.engine.reports import TARGET, Origin
from quickdraft.engine.sequence import Sequence, Work
from quickdraft.models.transformer import ROWWISE_MAX
from quickdraft.speculative.base import KFor, Proposal
from quickdraft.speculative.policy import HORIZON, StepPlan


def draft_budget(max_tokens: int, generated: int, room: int) -> int:
    """Most tokens a round may draft: one fewer than the tokens still to generate (the round's last token is the
    target's), and no more than the cache has room for. tune's replay follows the same rule."""
    return min(max_tokens - generated - 1, room)


@dataclass(eq=False)
class Drafting:
    """A round while it drafts: its proposal as a generator of draft passes (None: nothing to draft), the feed of
    its next pass, the proposal once done, and the seconds it has spent (its own work and the passes it was in)."""
    s: Sequence
    index: int  # its place in the step's plan
    steps: object = None
    feed: object = None
    proposal: Proposal | None = None
    seconds: float = 0.0
    reasons: dict | None = None  # per source, why the policy gave it drafts this round (policy._why)

    def advance(self, logits=None) -> None:
        """Run its drafting to its next pass (sent that pass's logits, if any), or to its end."""
        t0 = time.perf_counter()
        try:
            self.feed = next(self.steps) if logits is None else self.steps.send(logits)
        except StopIteration as done:
            self.feed, self.proposal = None, done.value
        finally:
            self.seconds += time.perf_counter() - t0


class Rounds:
    """The rounds of an engine's sequences (engine.Engine holds one)."""

    def __init__(self, engine):
        self.engine = engine
        self.policy = engine.policy
        self._masker: ThreadPoolExecutor | None = None  # computes verification masks during the target pass
        self.drafting = 0  # sequences running that have begun drafting (their texts are what the policy measures)

    # ---- before the pass: choose k, propose -----------------------------------------------------------------

    def begin(self, s: Sequence, index: int, plan: StepPlan) -> Drafting:
        """The round's k chosen in the step's plan (in order: each sequence's choice sees those before it) and its
        drafting begun, up to its first draft pass."""
        round = Drafting(s, index)
        args = self._proposal_args(s, plan.k_for(index, s, self.budget(s), self._lag(s), self._horizon(s)),
                                   lambda source, k, width: plan.branches(index, source, k, width, s.speculation))
        if args is None:
            round.proposal = Proposal([], "none")
            return round
        self.policy.last_reason.clear()
        round.steps = s.drafter.propose_steps(*args)
        round.advance()  # (its k is chosen here: before its drafter's first pass)
        round.reasons = dict(self.policy.last_reason)
        if round.proposal is not None:  # drafted whole: the next sequences' choices count its tree's rows
            plan.drafted(index, round.proposal)
        return round

    def propose(self, rounds: list[Drafting], plan: StepPlan, fail) -> dict[Sequence, torch.Tensor]:
        """Finish every round's drafting, each pass of the rounds still drafting run as one pass of their draft model
        (its rows read the weights once; a round alone runs its own), then their rows. fail(s, error): a sequence
        whose drafting failed (its drafter, its constraint) leaves the step."""
        while True:
            waiting = [r for r in rounds if r.proposal is None and r.feed is not None]
            if not waiting:
                break
            t0 = time.perf_counter()
            try:
                drafter = waiting[0].s.drafter
                logits = ([drafter.pass_logits(waiting[0].feed)] if len(waiting) == 1 else
                          drafter.batched_pass([r.s.drafter for r in waiting], [r.feed for r in waiting]))
            except Exception as e:  # noqa: BLE001 -- the shared pass: every sequence in it fails
                for r in waiting:
                    fail(r.s, e)
                    rounds.remove(r)
                continue
            seconds = time.perf_counter() - t0
            for r, row in zip(waiting, logits):
                r.seconds += seconds  # its pass: what drafting costs this sequence, beside others or not
                try:
                    r.advance(row)
                except Exception as e:  # noqa: BLE001 -- its drafter or constraint: that sequence fails
                    fail(r.s, e)
                    rounds.remove(r)
        feeds = {}
        for r in rounds:
            try:
                if r.steps is not None:
                    plan.drafted(r.index, r.proposal)
                feeds[r.s] = self._rows(r.s, r.proposal, r.seconds, r.reasons)
            except Exception as e:  # noqa: BLE001
                fail(r.s, e)
        return feeds

    def budget(self, s: Sequence) -> int:
        budget = draft_budget(s.params.max_tokens, s.generated, self.engine.context - len(s.tokens))
        max_draft = self.engine.max_draft
        return min(budget, max_draft) if max_draft is not None else budget

    @staticmethod
    def _lag(s: Sequence):
        """Per source, the tokens of the sequence its drafter would first have to take in."""
        return (lambda source: s.drafter.lag(s.tokens, source)) if s.drafter is not None else (lambda source: 0)

    @staticmethod
    def _horizon(s: Sequence) -> int:
        """The tokens still to come, as far as a drafter's catch-up must pay back (policy.HORIZON): at most what is
        left of max_tokens, at least the answer's length so far."""
        return min(s.params.max_tokens - s.generated, max(HORIZON, s.generated))

    def _proposal_args(self, s: Sequence, k_for: KFor, branches) -> tuple | None:
        """The arguments of the round's propose_steps: the sequence, k_for, its sampling, generator and constraint,
        and where a tree may be proposed its branches; None where the sequence drafts nothing."""
        if s.drafter is not None and not s.drafting:  # once the first token is out; what the drafter lacks of the
            self._begin_drafting(s)  # prompt it takes in when it first drafts, where the policy finds that it pays
        if s.drafter is None or self.budget(s) <= 0:
            return None
        generator = s.generators.on(s.drafter.device or self.engine.target.device)
        if self.trees(s):  # alternatives emit no more tokens than the chain beside them could, but their rows
            room = self.engine.context - len(s.tokens)  # must fit the cache and a row-wise pass

            def width(source: str, k: int) -> int:
                return branches(source, k, 1 + max(0, min(room - k, ROWWISE_MAX - 1 - k)))

            return s.tokens, k_for, s.params, generator, None, width
        # constrain_draft False drafts as llama.cpp does, blind to the grammar (for comparison)
        return s.tokens, k_for, s.params, generator, s.constraint if s.speculation.constrain_draft else None

    def _rows(self, s: Sequence, proposal: Proposal, draft_s: float, reasons: dict | None = None) -> torch.Tensor:
        """The round's work (the proposal, its drafting's seconds, a constraint's masks computed meanwhile) and the
        sequence's rows: its last token, then the proposal's."""
        masks = None
        if s.constraint is not None and proposal.tokens:
            if self._masker is None:  # its thread ends when the engine is collected (tests/test_grammar.py)
                self._masker = ThreadPoolExecutor(1, thread_name_prefix="quickdraft-mask")
            masks = self._masker.submit(s.constraint.lookahead_bitmasks, proposal.tokens)
        s.work = Work(proposal, draft_s, masks, (reasons or {}).get(proposal.source))
        return torch.tensor(s.tokens[-1:] + proposal.tokens, device=self.engine.target.device)

    def trees(self, s: Sequence) -> bool:
        """Whether this round may propose a tree (--draft-tree): its drafter able to, a target whose tree passes are
        its chain passes bit for bit (the CPU's row-wise kernels), no constraint and no log-probabilities asked for
        (both are per position of a chain)."""
        return (s.speculation.tree > 1 and s.drafter.trees and self.engine.target.trees
                and s.constraint is None and s.params.logprobs is None)

    def tree_note(self, s: Sequence) -> str:
        """Why a sequence that asked for trees verified none."""
        if not s.drafter.trees:
            return f"{self.engine.drafter_name} offers no candidates beside its chain: chains only"
        if not self.engine.target.trees:
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

    def ended(self, s: Sequence) -> None:
        """The sequence ended: it drafts no more."""
        if s.drafting:
            self.drafting -= 1

    # ---- after the pass: verify, record ---------------------------------------------------------------------

    def conclude(self, s: Sequence, logits: torch.Tensor, plan: StepPlan, t0: float):
        """From the logits of the sequence's rows: the tokens it adds to s.tokens, their scores and their Origin, the
        cache rolled back to match; what the round cost (from t0, when the target pass began, to its verification's
        end) and kept, recorded."""
        work, s.work = s.work, None
        proposal, draft_s = work.proposal, work.draft_s
        vocab, position = self.engine.vocab, len(s.tokens)
        if not proposal.tokens:
            chosen = verify.choose(s, logits)
            seconds = time.perf_counter() - t0
            plan.record_plain(seconds + draft_s, position)
            s.stats.record_plain(seconds + draft_s)
            return (*chosen, TARGET)
        drafting_s = draft_s - proposal.catch_up_s
        s.timings.draft_prefill_s += proposal.catch_up_s
        first = s.stats.sources[proposal.source] == 0  # its first round in this generation: a start
        catch_up_s = self.policy.record_catch_up(proposal.source, proposal.caught_up, proposal.catch_up_s, first)
        if proposal.parents is not None:
            tokens, path = verify.tree(s, proposal, logits, vocab)
            seconds = time.perf_counter() - t0
            accepted, scores, k = len(path) - 1, None, len(proposal.tokens)
            chain = sum(1 for row in path[1:] if row <= proposal.chain)  # the chain's drafts kept
            plan.record_round(proposal.source, proposal.chain, chain, drafting_s, seconds, catch_up_s, position,
                              tree_rows=k, tree_kept=accepted - chain)
            s.acceptance.record(proposal.source, proposal.chain, chain)
            s.stats.tree_rounds += 1  # (drafted counts the chain: its acceptance compares with chain rounds')
            s.stats.tree_alternatives_kept += accepted - chain
        else:
            tokens, accepted, scores = verify.chain(s, proposal, logits, work.masks, vocab)
            seconds = time.perf_counter() - t0
            k = len(proposal.tokens)
            plan.record_round(proposal.source, k, accepted, drafting_s, seconds, catch_up_s, position,
                              tree_possible=self.trees(s))
            s.acceptance.record(proposal.source, k, accepted)
        s.stats.record_round(proposal.source, proposal.chain if proposal.parents is not None else k, accepted,
                             len(tokens), draft_s, seconds, work.reason)
        return tokens, scores, Origin(proposal.source, accepted, k)
