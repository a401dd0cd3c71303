"""The constraint a generation runs: an llguidance matcher over the output so far, and its token masks.

The constrained distribution at a position is the usual processing chain (sampling.process) applied to
logits whose disallowed tokens are set to -inf first. Draft, verification and plain steps all apply the
same mask, so speculative output stays exactly the target's constrained output. (grammar.py describes and
compiles constraints.)
"""

from __future__ import annotations

import threading
import time

import torch

from quickdraft import grammar as grammars
from quickdraft.errors import QuickdraftError
from quickdraft.grammar import Grammar


class ConstraintError(QuickdraftError):
    """The constraint's matcher failed while generating (a resource limit of llguidance): the request's fault."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Building llguidance's view of a large vocabulary takes a while, so
    it is built once, on first use, and shared (thread-safe) by every generation."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's rows; ids the tokenizer lacks are never allowed
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = grammars.ll_tokenizer(self.tokenizer.backend.to_str(), self.vocab_size,
                                                           sorted(self.tokenizer.eos_ids))
            return self._ll_tokenizer

    def constraint(self, grammar: Grammar, compiled: str | None = None) -> "Constraint":
        """A fresh matcher for one generation; a QuickdraftError with the library's message if the grammar is
        invalid. compiled: its llguidance text when already compiled (grammar.to_llguidance, e.g. by the server's
        sandbox)."""
        text = compiled if compiled is not None else grammars.to_llguidance(grammar)
        matcher = grammars.matcher(self.ll_tokenizer, text, grammar)
        # a tokenizer without an end-of-generation token gets one chosen by llguidance: it ends outputs too
        return Constraint(matcher, self.vocab_size, grammar, frozenset(self.ll_tokenizer.eos_tokens))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's bitmasks (N, ceil(V / 32)) int32, bit j of word i for token 32 i + j -> bool (N, V)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


def apply(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens' logits -> -inf (logits (N, V) float, allowed (N, V) bool on the same device)."""
    return logits.masked_fill(~allowed, float("-inf"))


class Constraint:
    """One generation's matcher. Its state always follows the committed sequence (the engine advances it
    by each emitted token); drafting and verification look ahead with consume-then-rollback, so a
    rejected draft never leaves a trace.

    seconds: time spent computing masks, the share of a generation that structured output costs.
    """

    def __init__(self, matcher, vocab: int, grammar: Grammar, eos_ids: frozenset[int] = frozenset()):
        self.matcher = matcher
        self.eos_ids = eos_ids  # what the matcher takes as the end of the output
        self.vocab = vocab
        self.grammar = grammar
        self.words = (vocab + 31) // 32
        self.seconds = 0.0
        self.masks_computed = 0

    # ---- the state ----------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """The output is complete: nothing but an end-of-generation token may follow."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Commit one token (it came from a masked distribution, so the matcher takes it unless one of
        llguidance's resource limits stops it: ConstraintError)."""
        if not self.matcher.consume_token(token):
            self._fail()

    def _fail(self):
        reason = grammars.one_line(self.matcher.get_error()) if self.matcher.is_error() else "it refused a token"
        raise ConstraintError(f"the {self.grammar.describe()} failed while generating ({reason}): simplify it")

    def push(self, token: int) -> bool:
        """Look ahead by one token (undo with pop); False, and no change, if the grammar forbids it."""
        if self.matcher.is_stopped() or self.matcher.validate_tokens([token]) != 1:
            return False
        return self.matcher.consume_token(token)

    def pop(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, from the start, the grammar allows in a row (none past the one that ends it)."""
        n = 0
        for token in tokens:
            if not self.push(token):
                break
            n += 1
            if self.matcher.is_stopped():
                break
        self.pop(n)
        return n

    # ---- masks --------------------------------------------------------------------------------

    def bitmask(self) -> torch.Tensor:
        """The mask at the current state, (1, words) int32 on the CPU."""
        t0 = time.perf_counter()
        out = torch.empty(1, self.words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), self.words * 4)
        self.seconds += time.perf_counter() - t0
        self.masks_computed += 1
        if self.matcher.is_error():
            self._fail()
        return out

    def allowed(self, device) -> torch.Tensor:
        """Bool (1, V) on device: the tokens allowed next."""
        return unpack(self.bitmask().to(device), self.vocab)

    def lookahead_bitmasks(self, tokens: list[int]) -> torch.Tensor:
        """Masks at the current state and after each prefix of tokens: (len(tokens) + 1, words) int32.

        Rows past the first token the grammar refuses allow everything: verification never reaches them,
        since the target cannot accept a refused token. So does a row that would allow nothing (a finished
        output of a tokenizer without an end-of-generation token), which the engine never samples from.
        """
        rows = torch.full((len(tokens) + 1, self.words), -1, dtype=torch.int32)
        n = 0
        t0 = time.perf_counter()
        for i in range(len(tokens) + 1):
            self.matcher.unsafe_compute_mask_ptr(rows[i].data_ptr(), self.words * 4)
            self.masks_computed += 1
            if self.matcher.is_error():
                self._fail()
            if not rows[i].any():
                rows[i] = -1
            if i == len(tokens) or not self.push(tokens[i]):
                break
            n += 1
        self.pop(n)
        self.seconds += time.perf_counter() - t0
        return rows
