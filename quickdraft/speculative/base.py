"""What every drafter shares: the proposal it returns, and the interface the engine, tune, doctor and bench call.

A drafter describes itself: the models it runs (doctor checks their placement and memory, bench counts their
bytes), whether it samples from distributions, what one of its passes costs and what it would propose over a
known output (tune's replay). Nothing outside a drafter's own module needs to know which kind it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from quickdraft.config import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]
    source: str  # which drafter proposed them ("draft", "ngram")
    q_draft: torch.Tensor | None = None  # (len(tokens), V) processed distributions; None: deterministic
    catch_up_s: float = 0.0  # time spent feeding tokens the drafter had not seen (not drafting proper)
    caught_up: int = 0  # how many: the policy's cost of a token taken in (AdaptivePolicy.t_feed)
    # A tree (tree verification): node i's parent node (-1: the pending token); the first `chain` nodes are a chain,
    # each further one a leaf beside the chain node at its depth (an alternative candidate). None: a chain.
    parents: list[int] | None = None
    chain: int = 0

    def q_rows(self, vocab: int, device) -> torch.Tensor:
        """The distributions the tokens were drawn from; one-hot rows for a deterministic proposal."""
        if self.q_draft is not None:
            return self.q_draft
        q = torch.zeros(len(self.tokens), vocab, device=device)
        return q.scatter_(1, torch.tensor(self.tokens, device=device)[:, None], 1.0)


@dataclass
class Offer:
    """What a drafter would propose at one position of a known greedy output (tune's replay)."""
    source: str  # the source that would propose ("draft", "ngram"); "" when the drafter has nothing
    available: int  # how many tokens it would propose at most (a draft model stops early when unsure)
    kept: int  # how many of them the target keeps: the agreement with the known output
    # For trees (a drafter with `trees`): its top probability at each position it drafts, as its round's chain has
    # it (where it stops is `available`), and the rank in its distribution of the known token at the first position
    # it guessed wrong (1: its second choice; 0: none, or a token it gives no probability).
    confidence: tuple[float, ...] = ()
    rank: int = 0

    def tree_keeps(self, drafted: int, width: int) -> bool:
        """Whether a tree of `width` candidates beside a chain of `drafted` tokens keeps an alternative: the chain's
        first wrong guess is at its least sure position (where base.branch puts the alternatives) and the known
        token is among the width - 1 it would offer there."""
        if width < 2 or len(self.confidence) < drafted or self.kept >= drafted:
            return False
        j = min(range(drafted), key=lambda i: self.confidence[i])
        return j == self.kept and 1 <= self.rank <= width - 1


def replay_chain(source: str, step, pending: int, known: list[int], kmax: int, p_min: float, sure=None) -> Offer:
    """The Offer of a greedy round over a known output, run as the round would run it: step(token) feeds a token and
    returns the drafter's logits (V,) for the next position; the chain goes on past a wrong guess with the drafter's
    own tokens (a tree's least sure position is judged over the whole chain) and stops where the drafter is unsure
    (p_min, after its first token). known: the output's tokens from the round's first drafted position on. sure:
    what says how sure the drafter is of the step's token where not its top probability (DSpark's confidence)."""
    confidence, kept, rank, token = [], None, 0, pending
    for i in range(min(kmax, len(known))):
        logits = step(token).float()
        probs = logits.softmax(-1)
        top = float(probs.max())
        if i and p_min > 0 and (top if sure is None or sure() is None else float(sure())) < p_min:
            return Offer(source, i, len(confidence) if kept is None else kept, tuple(confidence), rank)
        confidence.append(top)
        token = int(logits.argmax())
        if kept is None and token != known[i]:
            kept = i
            rank = max(1, int((logits > logits[known[i]]).sum())) if float(probs[known[i]]) > 0 else 0
    return Offer(source, kmax, len(confidence) if kept is None else kept, tuple(confidence), rank)


# How many tokens to draft now, asked per source: the engine's policy answers.
KFor = Callable[[str], int]
# How many candidates to propose at a chain's least sure position, asked per source with the chain's length (1: a
# chain alone): the engine's policy answers where tree verification may run.
Branches = Callable[[str, int], int]


def branch(tokens: list[int], dists: list[torch.Tensor], q_rows: list, width: int) -> Proposal | None:
    """A drafted chain with up to width - 1 alternatives beside it, at the position where the drafter was least sure
    (its top probability lowest): the drafter's next most likely tokens there, deterministic candidates (one-hot q
    rows) tried after the chain's own. dists: the drafter's distribution at each chain position; q_rows: the chain's
    sampled distributions, or empty for deterministic drafts. None where there is nothing to add."""
    n = len(tokens)
    if width < 2 or n == 0 or len(dists) < n:
        return None
    j = min(range(n), key=lambda i: float(dists[i].max()))
    ranked = dists[j].topk(min(width, dists[j].shape[-1])).indices.tolist()
    alternatives = [t for t in ranked if t != tokens[j] and float(dists[j][t]) > 0][:width - 1]
    if not alternatives:
        return None
    q = None
    if q_rows:
        one_hot = torch.zeros(len(alternatives), q_rows[0].shape[-1], dtype=q_rows[0].dtype, device=q_rows[0].device)
        one_hot[torch.arange(len(alternatives)), torch.tensor(alternatives, device=one_hot.device)] = 1.0
        q = torch.cat([torch.stack(q_rows[:n]), one_hot])
    return Proposal(tokens + alternatives, "", q, parents=list(range(-1, n - 1)) + [j - 1] * len(alternatives),
                    chain=n)


def drive(steps, logits_of):
    """Run a drafting generator (propose_steps, _draft_steps) alone: each feed it yields through logits_of."""
    try:
        feed = next(steps)
        while True:
            feed = steps.send(logits_of(feed))
    except StopIteration as done:
        return done.value


class Drafter:
    """A drafter proposes tokens to follow the sequence; the target verifies them (engine.Engine).

    A kind of drafter (speculative/draft.py lists them) is a subclass with `kind`, `sources` and `propose`;
    `build` makes one from a draft description, `load` loads the models it needs first.
    """

    kind: ClassVar[str] = ""  # the draft description's kind it is built for
    # How the kind is written and loaded (speculative/draft.py asks these, never a kind's name):
    named: ClassVar[bool] = False  # written as its kind's name alone (ngram, suffix, mtp), not as a file
    lookup: ClassVar[bool] = False  # drafts by looking up what was written, no model: nothing to put lookup before
    text_model: ClassVar[bool] = False  # a model of its own fed the text (a draft model): --draft-window and
    # --draft-vocab are its settings
    layer_states: ClassVar[bool] = False  # reads the target's layer states (KVCache.keep_features): one per chain,
    # and int8 where the weights are "auto" and int4 would be chosen (a head over the target's states in int4 hardly
    # drafts: other engines' users saw acceptance fall to ~0; doctor warns where int4 is asked for)
    sources: tuple[str, ...] = ()  # the policy keeps statistics per source
    name: str = ""  # the draft description it was built from, as users write it
    device: torch.device | None = None
    samples: bool = False  # proposes from distributions (q_draft) when sampling, rather than deterministically
    reads_hidden: bool = False  # reads the target's hidden states (the engine's cache keeps them: attach)
    trees: bool = False  # proposes alternatives beside its chain when asked (propose's branches: tree verification)
    per_round: tuple[str, ...] = ()  # sources whose round costs one pass whatever it drafts (a DFlash block)

    @classmethod
    def recognizes(cls, source: str) -> bool:
        """Whether the file or directory `source` holds this kind's drafter (its config.json says so); the draft
        model kind takes what no kind recognizes."""
        return False

    @classmethod
    def flavour(cls, draft) -> str:
        """The kind as other engines name its method (tools/export.py), for `draft` (a Draft of this kind)."""
        return cls.kind

    @classmethod
    def load(cls, draft, target, load) -> list:
        """The models this kind of drafter runs for `draft` (a Draft), each loaded once by load(source) (a model
        with its own decoder: weights/loader.load_model in the target's dtype, on the draft's device, in the draft's
        format) or load(source, make) for one the kind builds itself: make(dtype, weights, capacity), on the
        target's device."""
        return []

    @classmethod
    def build(cls, draft, target, models: list, capacity: int, speculation) -> "Drafter":
        """A drafter for `draft` speaking for `target` (a LoadedModel), with the models `load` gave."""
        raise NotImplementedError

    @property
    def models(self) -> tuple:
        """The LoadedModels this drafter runs (none for n-gram lookup)."""
        return ()

    def attach(self, cache) -> None:
        """The engine's KV cache, for a drafter that reads the target's hidden states there (reads_hidden)."""

    @property
    def cut_head(self) -> bool:
        """It drafts with its output head cut to part of the vocabulary (--draft-vocab: speculative/subset.py)."""
        return False

    @property
    def max_draft(self) -> int | None:
        """The most tokens a round may ask of it (a hybrid draft model's recurrent state rolls back a bounded number
        of positions); None: no bound of its own."""
        return None

    def fork(self) -> "Drafter":
        """A drafter of the same kind over the same models, with state of its own (a draft model's cache): the
        engine keeps one per cache slot (runtime/slots.py)."""
        raise NotImplementedError

    def adopt(self, other: "Drafter", n: int) -> None:
        """Take what `other` (a drafter of the same kind) holds of the first n tokens of its sequence: the slot it
        speaks for took other's slot's first n tokens (runtime/slots.Slot.copy_prefix). Nothing to take by
        default."""

    def forget(self) -> None:
        """Drop what it holds of its slot's sequence: the slot forgot its tokens (a new conversation, or a pass
        that stopped half way). Nothing to drop by default."""

    def scoped(self, scope) -> None:
        """The generation about to begin is `scope`'s (a client: what it may draft from of what others were answered:
        speculative/suffix.History). Nothing by default."""

    def finish(self, tokens: list[int], prompt_n: int) -> None:
        """A generation of its slot ended with `tokens` (its prompt's first prompt_n, then the answer): a drafter that
        learns from what was answered takes it in. Nothing by default."""

    def lag(self, seq: list[int], source: str) -> int:
        """Tokens of seq that drafting from `source` now would first have to take in (a draft model that skipped
        plain steps, or was begun without its prefill); 0 for a drafter that reads the sequence as it is."""
        return 0

    def begin(self, prompt: list[int], prefill: bool = True) -> None:
        """Start a generation: take in the prompt (a draft model prefills it, keeping what its cache already holds
        of it from this slot's last generation). prefill False: only start; what it needs of the prompt it takes
        in when it first drafts (engine.Batch: a draft model's prefill would stall every sequence beside it, and
        the batch may never ask it to draft)."""

    def propose(self, seq: list[int], k_for: KFor, params: SamplingParams,
                generator: torch.Generator, constraint=None, branches: Branches | None = None) -> Proposal:
        """Propose up to k_for(source) tokens to follow seq (prompt + tokens generated so far).

        constraint (a constraint.Constraint at the state after seq): propose only what it allows, and leave
        its state as it was found. branches (a drafter with `trees` only, never with a constraint): how many
        candidates to offer at the chain's least sure position (a tree: Proposal.parents).
        """
        raise NotImplementedError

    batchable: bool = False  # its passes may run beside other sequences' (a draft model's: propose_steps)

    def pass_logits(self, feed) -> torch.Tensor:
        """One pass of what propose_steps yielded, alone (a batchable drafter's)."""
        raise NotImplementedError

    def batched_pass(self, drafters: list, feeds: list) -> list[torch.Tensor]:
        """The passes of several sequences' drafters (this kind, one model) as one (a batchable drafter's)."""
        raise NotImplementedError

    def propose_steps(self, seq: list[int], k_for: KFor, params: SamplingParams, generator: torch.Generator,
                      constraint=None, branches: Branches | None = None):
        """propose as a generator that yields the feed of each pass it would run and is sent the pass's logits
        (engine.Engine.plan runs batchable drafters' passes as one). Here: propose itself, no pass yielded."""
        if branches is not None:
            return self.propose(seq, k_for, params, generator, constraint, branches)
        return self.propose(seq, k_for, params, generator, constraint)
        yield  # a generator

    # ---- self-description, for tune, doctor and bench -------------------------------------------------------

    def cache_bytes(self) -> int:
        """Bytes of the drafter's own caches (a draft model's KV cache)."""
        return 0

    @classmethod
    def planned(cls, draft, target_cfg, device: torch.device, dtype: torch.dtype, context: int,
                window: int | None = None) -> list:
        """What this kind will hold on the target's device for `draft` (a Draft), worked out before anything is
        loaded: its weights where they share the target's device, its caches for `context` positions, and an
        "activations" item for a pass of its own (weights/memory.py's Items; the memory plan sets them beside the
        target's). target_cfg: the target's ModelConfig; window: the draft window asked for (--draft-window; None:
        the device's default). Nothing by default."""
        return []

    def pass_seconds(self, prompt: list[int]) -> float:
        """Seconds of one drafting pass after prompt (one drafted token of a draft model); 0 without a model."""
        return 0.0

    def offers(self, prompt: list[int], output: list[int], kmax: int) -> list[Offer]:
        """What the drafter would propose at each decode position t = 0..len(output) - 1 of a known greedy
        output (seq = prompt + output[:t]; t = 0 comes from the prompt's pass: nothing), drafting up to kmax."""
        return [Offer("", 0, 0)] * len(output)

    def replay_round(self, source: str, drafted: int, stopped_early: bool, kept: int, behind: int) -> tuple[int, int]:
        """A round's cost in this drafter's passes, as propose would run it, and how many tokens of the sequence
        the drafter has not seen afterwards. behind: tokens it had not seen before the round; source "" and
        drafted 0: a plain step. The default is a drafter without passes of its own."""
        return 0, behind + kept + 1
