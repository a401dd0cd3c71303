"""Structured output: constraints by JSON schema, regular expression or grammar, through llguidance.

llguidance (guidance-ai's Rust library) compiles the constraint and keeps a matcher that computes, for the
state reached so far, the bitmask of tokens that may come next; it consumes tokens and rolls them back,
which is what speculation needs: the draft advances the matcher through its own guesses, verification
computes the mask at every drafted position, and what the target rejects is rolled back.

The constrained distribution at a position is the usual processing chain (sampling.process) applied to
logits whose disallowed tokens are set to -inf first. Draft, verification and plain steps all apply the
same mask, so speculative output stays exactly the target's constrained output.

Why llguidance rather than xgrammar (scripts/bench_grammar.py compares both on our vocabularies): both
roll back and both compute a mask in far less time than a round takes (the README has the figures), but
llguidance has no dependencies at all, while xgrammar pulls in transformers and triton;
llguidance takes JSON schema, regex, Lark and llama.cpp's GBNF, and builds its tokenizer from the
tokenizer.json text we already hold.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass

import torch

from quickdraft.errors import QuickdraftError

KINDS = ("json_schema", "json_object", "regex", "grammar")
# Whitespace between JSON tokens: none, one space, or a newline and up to 20 spaces or tabs of indentation
# (llama.cpp's rule). Compact, spaced and pretty-printed JSON all match; an endless run of blanks, the way a
# constrained model can fail to ever finish, does not.
JSON_WHITESPACE = r"(\x20|\n[\x20\t]{0,20})?"


@dataclass(frozen=True)
class Grammar:
    """What the output must match. kind: json_schema (text: the schema as JSON), json_object (any JSON
    object; text unused), regex (text: the expression), grammar (text: GBNF as llama.cpp writes it, or Lark)."""

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise QuickdraftError(f"unknown constraint kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def describe(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regular expression",
                "grammar": "grammar"}[self.kind]


_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


def one_line(message: str) -> str:
    """The library's message on one line: its source excerpts ("   1 | start: ...") and caret lines dropped."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"} and not re.match(r"^\d+ \|", line)]
    return " ".join(kept) or message.strip()


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise QuickdraftError("structured output needs the llguidance package: pip install llguidance") from e
    return llguidance


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
                llg = _llguidance()
                try:
                    self._ll_tokenizer = llg.LLTokenizer(
                        self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                        eos_token=sorted(self.tokenizer.eos_ids) or None)
                except Exception as e:  # noqa: BLE001 - the library's message is the useful part
                    raise QuickdraftError(f"structured output is not available for this tokenizer: {e}") from e
            return self._ll_tokenizer

    def _grammar(self, grammar: Grammar) -> str:
        """The grammar as llguidance's grammar text (checked when a matcher is built from it)."""
        llg = _llguidance()
        try:
            if grammar.kind == "json_object":
                text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
            elif grammar.kind == "json_schema":
                try:
                    schema = json.loads(grammar.text)
                except json.JSONDecodeError as e:
                    raise QuickdraftError(f"the JSON schema is not valid JSON: {e}") from e
                if not isinstance(schema, dict):
                    raise QuickdraftError("the JSON schema must be a JSON object, e.g. {\"type\": \"object\"}")
                text = llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
            elif grammar.kind == "regex":
                text = llg.LLMatcher.grammar_from_regex(grammar.text)
            else:
                text = llg.grammar_from("grammar", grammar.text)  # GBNF or Lark, told apart by the library
        except ValueError as e:
            raise QuickdraftError(f"invalid {grammar.describe()}: {one_line(str(e))}") from e
        return text

    def constraint(self, grammar: Grammar) -> "Constraint":
        """A fresh matcher for one generation; a QuickdraftError with the library's message if grammar is invalid."""
        matcher = _llguidance().LLMatcher(self.ll_tokenizer, self._grammar(grammar), log_level=0)
        if matcher.is_error():
            raise QuickdraftError(f"invalid {grammar.describe()}: {one_line(matcher.get_error())}")
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
        """Commit one token (it came from a masked distribution, so the matcher takes it)."""
        if not self.matcher.consume_token(token):
            raise QuickdraftError(f"internal error: the constraint refused token {token}: "
                                  f"{self.matcher.get_error()}")

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
            if not rows[i].any():
                rows[i] = -1
            if i == len(tokens) or not self.push(tokens[i]):
                break
            n += 1
        self.pop(n)
        self.seconds += time.perf_counter() - t0
        return rows
