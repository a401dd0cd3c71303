"""A sequence is an object: everything one generation owns, from its prompt to its detokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft import sampling
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.constraint import Constraint
from quickdraft.engine.reports import Timings
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.slots import Slot
from quickdraft.speculative.base import Drafter, Proposal
from quickdraft.speculative.policy import Acceptance
from quickdraft.speculative.stats import SpeculationStats


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
class Work:
    """A step's drafting, kept from planning its pass to concluding it."""
    proposal: Proposal
    draft_s: float
    masks: object | None  # the future of the drafts' grammar masks (under a constraint)
    reason: str | None = None  # why the policy gave its source drafts (policy._why; None: a fixed k)


@dataclass(eq=False)  # one generation is itself: two with the same prompt are two
class Sequence:
    """Everything one generation owns (a sequence is an object): its tokens, the slot whose cache holds them
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
    waited: int = 0  # steps in a row its prefill got no rows (the shortest went first): STARVED of them go first
    steps: int = 0  # the number of the next step (0: the prefill; Event.step)
    first: float | None = None  # when its first token was chosen
    drafting: bool = False  # its drafter has taken in the prompt (after the first token)
    work: Work | None = None  # the current step's drafts, between planning the pass and concluding it
    # its own per source (how a batch plans its k): its slot's, carried from the turns of its conversation before
    acceptance: Acceptance = field(default_factory=Acceptance)
    finish: str | None = None  # why it ended (Event.finish_reason), once it has
    ended: bool = False  # released: its last event (the final Event, or what it failed with) is out

    @property
    def cache(self) -> KVCache:
        return self.slot.cache

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def copyable(self) -> bool:
        """A beginning of its prompt may be copied into its cache from another running sequence's (engine/scheduler.py):
        not a recurrent state's (a running sequence keeps none at the common prefix)."""
        return not self.slot.cache.recurrent

    @property
    def prefilling(self) -> bool:
        """Its cache does not hold all of its prompt yet."""
        return self.prefilled < len(self.prompt)
