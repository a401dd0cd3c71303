"""Structured output, described and compiled: constraints by JSON schema, regular expression or grammar, through
llguidance. (constraint.py holds the matcher a generation runs; this module needs no PyTorch, so that the server's
compile sandbox, server/sandbox.py, can run it in a small child process.)

llguidance (guidance-ai's Rust library) compiles the constraint and keeps a matcher that computes, for the
state reached so far, the bitmask of tokens that may come next; it consumes tokens and rolls them back,
which is what speculation needs: the draft advances the matcher through its own guesses, verification
computes the mask at every drafted position, and what the target rejects is rolled back.

Why llguidance rather than xgrammar (scripts/bench_grammar.py compares both on our vocabularies): both
roll back and both compute a mask in far less time than a round takes (scripts/bench_grammar.py measures both), but
llguidance has no dependencies at all, while xgrammar pulls in transformers and triton;
llguidance takes JSON schema, regex, Lark and llama.cpp's GBNF, and builds its tokenizer from the
tokenizer.json text we already hold.

Bounds. llguidance recurses over a grammar's structure when it builds a matcher: a chain of a few thousand rules
or schema references overflows the stack and kills the process (a segfault, nothing to catch), and its GBNF
reader takes time quadratic in the rules. `check_bounds` refuses what is far beyond any real constraint before
anything is compiled; the server also compiles each constraint in a child process first (server/sandbox.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from quickdraft.errors import QuickdraftError

KINDS = ("json_schema", "json_object", "regex", "grammar")
# Whitespace between JSON tokens: none, one space, or a newline and up to 20 spaces or tabs of indentation
# (llama.cpp's rule). Compact, spaced and pretty-printed JSON all match; an endless run of blanks, the way a
# constrained model can fail to ever finish, does not.
JSON_WHITESPACE = r"(\x20|\n[\x20\t]{0,20})?"

# What a constraint may be at most (see the module's note; the limits that crash llguidance are several times
# larger: a chain of ~3000 Lark rules, ~4000 schema references)
MAX_BYTES = {"json_schema": 128 << 10, "json_object": 0, "regex": 8 << 10, "grammar": 64 << 10}
MAX_RULES = 1000  # rule definitions of a grammar
MAX_NESTING = 64  # brackets within brackets in a grammar or regex; objects and lists within each other in a schema
MAX_REFS = 500  # "$ref"s in a schema
TRIAL_STEPS = 4  # tokens a trial walks through (constraint.trial): llguidance builds some of its lexer lazily


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
    lines = [line.strip() for line in message.replace("<non-verbose/>", "").splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"} and not re.match(r"^\d+ \|", line)]
    return " ".join(kept) or message.strip()


def llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise QuickdraftError("structured output needs the llguidance package: pip install llguidance") from e
    return llguidance


def parser_limits():
    """llguidance's resource limits, its defaults but for errors: they never show its internal state."""
    return llguidance().LLParserLimits(verbose_errors=False)


# ---- bounds -------------------------------------------------------------------------------------------------

def check_bounds(grammar: Grammar) -> None:
    """Refuse a constraint beyond the bounds above, naming the bound (QuickdraftError)."""
    size = len(grammar.text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES[grammar.kind]:
        raise QuickdraftError(f"the {grammar.describe()} is {size} bytes: at most {MAX_BYTES[grammar.kind]} are "
                              "accepted; simplify it")
    if grammar.kind == "grammar":
        rules = _rules(grammar.text)
        if rules > MAX_RULES:
            raise QuickdraftError(f"the grammar defines {rules} rules: at most {MAX_RULES} are accepted; simplify it")
    if grammar.kind in ("grammar", "regex"):
        depth = _bracket_depth(grammar.text)
        if depth > MAX_NESTING:
            raise QuickdraftError(f"the {grammar.describe()} nests brackets {depth} deep: at most {MAX_NESTING}")
    if grammar.kind == "json_schema":
        schema = _schema(grammar.text)
        depth, refs = _shape(schema)
        if depth > MAX_NESTING:
            raise QuickdraftError(f"the JSON schema nests {depth} levels deep: at most {MAX_NESTING} are accepted")
        if refs > MAX_REFS:
            raise QuickdraftError(f"the JSON schema has {refs} $ref: at most {MAX_REFS} are accepted")


def _rules(text: str) -> int:
    """Rule definitions of a grammar, whatever line break separates them (llguidance's GBNF reader takes a carriage
    return as one; a count over newlines alone saw a whole chain as one rule), and at least its GBNF `::=`s."""
    lines = "\n".join(text.splitlines())  # \r, \r\n, \v, \f, \x85, \u2028, ... as \n
    return max(len(re.findall(r"^\s*\??[A-Za-z_][\w.-]*\s*(::=|:)", lines, re.M)), text.count("::="))


def _bracket_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} outside quoted strings (an estimate: escapes are skipped)."""
    depth = deepest = 0
    quote = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise QuickdraftError(f"the JSON schema nests too deeply: at most {MAX_NESTING} levels are accepted") from None
    except json.JSONDecodeError as e:
        raise QuickdraftError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise QuickdraftError("the JSON schema must be a JSON object, e.g. {\"type\": \"object\"}")
    return schema


def _shape(value) -> tuple[int, int]:
    """(nesting depth, number of "$ref" keys) of a JSON value, without recursion."""
    deepest, refs = 0, 0
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, depth)
            refs += "$ref" in v
            stack += [(x, depth + 1) for x in v.values()]
        elif isinstance(v, list):
            deepest = max(deepest, depth)
            stack += [(x, depth + 1) for x in v]
    return deepest, refs


# ---- compiling ----------------------------------------------------------------------------------------------

def to_llguidance(grammar: Grammar, bounds: bool = True) -> str:
    """The constraint as llguidance's grammar text, within the bounds (checked again when a matcher is built)."""
    if bounds:
        check_bounds(grammar)
    llg = llguidance()
    try:
        if grammar.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if grammar.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(_schema(grammar.text), overrides=_JSON_OPTIONS)
        if grammar.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(grammar.text)
        return llg.grammar_from("grammar", grammar.text)  # GBNF or Lark, told apart by the library
    except (ValueError, RecursionError) as e:
        raise QuickdraftError(f"invalid {grammar.describe()}: {one_line(str(e))}") from e


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
    """llguidance's view of a vocabulary (from tokenizer.json text; ids up to vocab_size, the model's rows)."""
    try:
        return llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)
    except Exception as e:  # noqa: BLE001 - the library's message is the useful part
        raise QuickdraftError(f"structured output is not available for this tokenizer: {e}") from e


def matcher(ll_tok, text: str, grammar: Grammar):
    """A fresh llguidance matcher for grammar text (to_llguidance's); QuickdraftError if it does not compile."""
    import array

    m = llguidance().LLMatcher(ll_tok, text, log_level=0, limits=parser_limits())
    if m.is_error():
        raise QuickdraftError(f"invalid {grammar.describe()}: {one_line(m.get_error())}")
    words = (ll_tok.vocab_size + 31) // 32
    mask = array.array("i", bytes(4 * words))
    m.unsafe_compute_mask_ptr(mask.buffer_info()[0], 4 * words)  # (what the first token may be: computed once)
    ends = set(ll_tok.eos_tokens)
    if not m.is_error() and all(32 * i + b in ends for i, w in enumerate(mask) if w for b in range(32) if w >> b & 1):
        raise QuickdraftError(f"the {grammar.describe()} matches only the empty text: nothing could be generated; "
                              "give it something to match (a grammar's root at least one symbol)")
    return m


def trial(ll_tok, text: str, grammar: Grammar, steps: int = TRIAL_STEPS) -> None:
    """Build a matcher and walk it through its first tokens (each time the lowest id allowed), as a generation
    would: llguidance builds parts of its lexer lazily, and some constraints compile, then fail at the first
    token (QuickdraftError)."""
    import array

    m = matcher(ll_tok, text, grammar)
    words = (ll_tok.vocab_size + 31) // 32
    mask = array.array("i", bytes(4 * words))
    for _ in range(steps):
        m.unsafe_compute_mask_ptr(mask.buffer_info()[0], 4 * words)
        allowed = next((32 * i + (w & -w).bit_length() - 1 for i, w in enumerate(mask) if w), None)
        if m.is_error() or allowed is None or m.is_stopped() or not m.consume_token(allowed):
            break
    if m.is_error():
        raise QuickdraftError(f"invalid {grammar.describe()}: {one_line(m.get_error())}")
