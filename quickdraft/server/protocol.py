"""The OpenAI wire format: request bodies (validated strictly; server/bodies.py reads them) and the response
objects built from events.

Request fields follow OpenAI's names (structured output by `response_format`, tools, logprobs); ours are `top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, a `speculative` object, and `grammar` / `regex` constraints; llama-server's
(`n_predict`, `json_schema`, `repeat_penalty`, `n_probs`, `cache_prompt`, `samplers`, ...) do what they do there.
Nothing is silently ignored: a field we do not implement is accepted only at the value that means "off" (LLAMA_OFF),
and any other field, or another value, gets a 400 that names it (docs/server.md, "Nothing is silently ignored",
lists every decision).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quickdraft.config import MAX_DRAFT, MAX_TOP_LOGPROBS, SAMPLING_BOUNDS
from quickdraft.grammar import Grammar
from quickdraft.speculative.stats import SpeculationStats

if TYPE_CHECKING:  # the wire format reads what the engine reports, and needs nothing else of it
    from quickdraft.engine import Timings

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # a stop string's length (matching is linear in it: server/stops.py)


# A request's field (or the server's flag) for each setting a QuickdraftError may name (errors.py)
FIELDS = {"chat": "messages (/v1/completions takes a raw prompt)", "max_tokens": "max_tokens",
          "context": "the server's context (serve --ctx)", "prompt": "the prompt", "draft_max": "speculative.draft_max",
          "draft_min": "speculative.draft_min", "tree": "speculative.tree", "p_min": "speculative.p_min"}


def say(problem) -> str:
    """A QuickdraftError as the server writes it (its settings as the request's fields); other text as it is."""
    return problem.say(FIELDS) if hasattr(problem, "say") else str(problem)


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        # a path through the body may hold a key with a lone surrogate ("\\ud800"), which no JSON encoder writes
        message, param = _writable(message), _writable(param) if param is not None else None
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _writable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Strict(BaseModel):
    # strict: "0.5" is not a temperature; no NaN or infinity anywhere; a field nobody defined is an error
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class Speculative(_Strict):
    """Per-request speculation: {"draft_max": 0} turns it off; {"draft_max": 4, "adaptive": false} fixes k;
    {"tree": 3} verifies trees of up to 3 candidates (--draft-tree; 1: chains)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    draft_max: int | None = Field(None, ge=0, le=MAX_DRAFT)
    draft_min: int | None = Field(None, ge=0, le=MAX_DRAFT)
    adaptive: bool | None = None
    tree: int | None = Field(None, ge=1, le=8)


class StreamOptions(_Strict):
    include_usage: bool = False


# llama-server's sampler and slot fields that quickdraft does not implement, and when each is "off" (accepted as a
# no-op then: it is what llama-server does with that value); any other value is a 400 naming the field
def _bounds(name: str) -> dict:
    """A sampling setting's bounds as pydantic Field constraints (declared once: config.SAMPLING_BOUNDS)."""
    return SAMPLING_BOUNDS[name][0]


def _off(value, *offs) -> bool:
    return value in offs


LLAMA_OFF = {
    "typical_p": (lambda v, b: _off(v, 1, 1.0), "1 (typical sampling off)"),
    "typ_p": (lambda v, b: _off(v, 1, 1.0), "1 (typical sampling off)"),
    "tfs_z": (lambda v, b: _off(v, 1, 1.0), "1 (tail-free sampling off)"),
    "mirostat": (lambda v, b: _off(v, 0), "0 (mirostat off)"),
    "mirostat_tau": (lambda v, b: not b.get("mirostat"), "absent while mirostat is off"),
    "mirostat_eta": (lambda v, b: not b.get("mirostat"), "absent while mirostat is off"),
    "dry_multiplier": (lambda v, b: _off(v, 0, 0.0), "0 (DRY off)"),
    "dry_base": (lambda v, b: not b.get("dry_multiplier"), "anything while dry_multiplier is 0"),
    "dry_allowed_length": (lambda v, b: not b.get("dry_multiplier"), "anything while dry_multiplier is 0"),
    "dry_penalty_last_n": (lambda v, b: not b.get("dry_multiplier"), "anything while dry_multiplier is 0"),
    "dry_sequence_breakers": (lambda v, b: not b.get("dry_multiplier"), "anything while dry_multiplier is 0"),
    "xtc_probability": (lambda v, b: _off(v, 0, 0.0), "0 (XTC off)"),
    "xtc_threshold": (lambda v, b: not b.get("xtc_probability"), "anything while xtc_probability is 0"),
    "top_n_sigma": (lambda v, b: isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0,
                    "-1 (top-n-sigma off)"),
    "dynatemp_range": (lambda v, b: _off(v, 0, 0.0), "0 (dynamic temperature off)"),
    "dynatemp_exponent": (lambda v, b: not b.get("dynatemp_range"), "anything while dynatemp_range is 0"),
    "penalize_nl": (lambda v, b: v is False, "false"),
    "min_keep": (lambda v, b: _off(v, 0, 1), "0 or 1 (the likeliest token is always kept)"),
    # a prompt that does not fit is refused here, never shifted: what to keep in a shift never matters
    "n_keep": (lambda v, b: isinstance(v, int) and not isinstance(v, bool), "a whole number (no context shift here)"),
    "n_discard": (lambda v, b: isinstance(v, int) and not isinstance(v, bool), "a whole number (no context shift here)"),
    "id_slot": (lambda v, b: _off(v, -1, 0), "-1 or 0 (one slot)"),
    "t_max_predict_ms": (lambda v, b: _off(v, 0), "0 (no time limit)"),
    "return_tokens": (lambda v, b: v is False, "false"),
    "lora": (lambda v, b: v in ([], None), "empty (no adapters)"),
    "image_data": (lambda v, b: v in ([], None), "empty (text models only)"),
    # OpenAI's
    "logit_bias": (lambda v, b: v in ({}, None), "empty"),
    "store": (lambda v, b: v in (False, None), "false (nothing is stored here)"),
    "metadata": (lambda v, b: v in ({}, None), "empty (nothing is stored here)"),
    "service_tier": (lambda v, b: v in ("auto", "default", None), '"auto" or "default" (one tier)'),
    "modalities": (lambda v, b: v in (["text"], None), '["text"]'),
}
# OpenAI fields that ask for what this server does not have: a 400 saying so, whatever the value
UNSUPPORTED = {
    "functions": "the deprecated functions field: send tools", "function_call": "the deprecated function_call: "
    "send tool_choice", "audio": "audio output", "prediction": "predicted outputs", "reasoning_effort":
    "reasoning effort", "web_search_options": "web search", "verbosity": "verbosity",
}
ACCEPTED = {"user": "an end-user id for abuse monitoring: accepted, unused (nothing is logged per user)"}
# llama.cpp's sampler names for `samplers`, and ours among them in the order quickdraft applies them
LLAMA_SAMPLERS = {"penalties", "dry", "top_n_sigma", "top_k", "typ_p", "typical_p", "top_p", "min_p", "xtc",
                  "temperature", "infill"}
SAMPLER_ORDER = ["penalties", "temperature", "top_k", "top_p", "min_p"]


# What a field of several accepted shapes should be, said once instead of once per shape.
SHAPES = {
    "prompt": "a string, a list with one string, or a list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}


class _Sampling(_Strict):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")  # extras: check_fields
    model: str | None = Field(None, max_length=256)  # a name; other names are logged (app.note_other_name)
    max_tokens: int | None = Field(None, ge=0)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's max_tokens (-1: to the end of the context)
    temperature: float = Field(1.0, **_bounds("temperature"))
    top_p: float = Field(1.0, **_bounds("top_p"))
    top_k: int = Field(0, **_bounds("top_k"))
    min_p: float = Field(0.0, **_bounds("min_p"))
    presence_penalty: float = Field(0.0, **_bounds("presence_penalty"))
    frequency_penalty: float = Field(0.0, **_bounds("frequency_penalty"))
    repetition_penalty: float | None = Field(None, **_bounds("repetition_penalty"))
    repeat_penalty: float | None = Field(None, **_bounds("repetition_penalty"))  # llama-server's name for it
    repeat_last_n: int | None = Field(None, ge=-1)  # llama-server's penalty window: 0 off, -1 all
    penalty_last_n: int | None = Field(None, ge=-1)  # its older name
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: Speculative | None = None
    speculation_trace: bool = False  # ours: each token's source, step and k in the chunks (the chat page's colours)
    cache_prompt: bool = True  # llama-server's: reuse what a kept slot holds of the prompt (false: prefill it all;
    #                            the output is the same either way)
    samplers: list[str] | str | None = None  # llama-server's sampler order: accepted when it is ours
    n_probs: int | None = Field(None, ge=0, le=20)  # llama-server's count of top log-probabilities
    post_sampling_probs: bool = False  # llama-server's: the sampled distribution's, not the model's
    # structured output: at most one of these
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...} as OpenAI's
    json_schema: dict | None = None  # llama-server's
    grammar: str | None = None  # GBNF (llama.cpp's) or Lark
    regex: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", "stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"a stop string may be at most {MAX_STOP_CHARS} characters long", "stop")
        return stops

    def check_fields(self) -> None:
        """Every field is one we implement, or at a value that means off (see the module's note)."""
        if self.n != 1:
            raise APIError(400, "n other than 1 is not supported: send one request per completion", "n")
        body = {**(self.model_extra or {}), **self.model_dump(exclude_unset=True)}
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                raise APIError(400, f"{UNSUPPORTED[name]} is not supported here: drop the {name} field", name)
            if name in ACCEPTED:
                continue
            if name not in LLAMA_OFF:
                raise APIError(400, f"unknown field {name!r}: quickdraft does not know it (docs/server.md lists the "
                                    "fields it takes); drop it", name)
            check, off = LLAMA_OFF[name]
            if not check(value, body):
                raise APIError(400, f"{name}={json.dumps(value)} is not supported: quickdraft does not implement it; "
                                    f"drop the field or set it to {off}", name)
        if self.max_tokens is not None and self.n_predict is not None and self.n_predict != self.max_tokens:
            raise APIError(400, "max_tokens and n_predict disagree: give one", "n_predict")
        if self.repetition_penalty is not None and self.repeat_penalty is not None \
                and self.repetition_penalty != self.repeat_penalty:
            raise APIError(400, "repetition_penalty and repeat_penalty disagree: give one", "repeat_penalty")
        if self.samplers is not None:
            self._check_samplers()

    def _check_samplers(self) -> None:
        """llama-server's sampler order, accepted when the samplers it names are ones quickdraft runs (or off) and
        those that are on come in quickdraft's order (penalties, temperature, top-k, top-p, min-p)."""
        names = list(self.samplers) if isinstance(self.samplers, list) else \
            [_SAMPLER_LETTERS.get(c, c) for c in self.samplers]
        unknown = [n for n in names if n not in LLAMA_SAMPLERS]
        if unknown:
            raise APIError(400, f"unknown sampler {unknown[0]!r} in samplers: llama.cpp's are "
                                f"{', '.join(sorted(LLAMA_SAMPLERS))}", "samplers")
        on = {"penalties": self.penalty_value() != 1.0 or bool(self.presence_penalty or self.frequency_penalty),
              "temperature": self.temperature not in (0.0, 1.0), "top_k": self.top_k > 0,
              "top_p": self.top_p < 1.0, "min_p": self.min_p > 0}
        order = [n for n in names if on.get(n)]
        ours = [n for n in SAMPLER_ORDER if n in order]
        if order != ours:
            raise APIError(400, f"samplers puts {', '.join(order)} in an order quickdraft does not run: it applies "
                                f"{', '.join(SAMPLER_ORDER)} in that order; drop samplers or follow it", "samplers")
        missing = [n for n, active in on.items() if active and n not in names]
        if missing:
            raise APIError(400, f"samplers leaves out {', '.join(missing)}, which this request sets: add it or drop "
                                "the setting", "samplers")

    def penalty_value(self) -> float:
        return self.repetition_penalty if self.repetition_penalty is not None else \
            self.repeat_penalty if self.repeat_penalty is not None else 1.0

    def penalty_window(self) -> int | None:
        """llama-server's repeat_last_n as quickdraft's window (0: the whole sequence); None: the default."""
        n = self.repeat_last_n if self.repeat_last_n is not None else self.penalty_last_n
        return None if n is None else 0 if n == -1 else n

    def requested_max_tokens(self) -> int | None:
        """max_tokens (or max_completion_tokens, or n_predict); None: to the end of the context."""
        if self.max_tokens is not None:
            return self.max_tokens
        return None if self.n_predict in (None, -1) else self.n_predict

    def logprobs_count(self) -> int | None:
        """How many top alternatives to report with each token's log-probability; None: none at all."""
        raise NotImplementedError

    def requested_grammar(self) -> Grammar | None:
        """The constraint the request asks for (compiled later: an invalid one is a 400 with its message)."""
        asked = []
        if self.response_format is not None:
            asked += _response_format(self.response_format)
        if self.json_schema is not None:
            asked.append(Grammar.json_schema(self.json_schema))
        if self.grammar is not None:
            asked.append(Grammar("grammar", self.grammar))
        if self.regex is not None:
            asked.append(Grammar("regex", self.regex))
        if len(asked) > 1:
            raise APIError(400, "give at most one of response_format (json_object or json_schema), json_schema, "
                                "grammar and regex", "response_format")
        return asked[0] if asked else None


_SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
                    "x": "xtc", "t": "temperature", "s": "top_n_sigma"}


def constraint_field(kind: str) -> str:
    """The request field a constraint of this kind came from."""
    return "response_format" if kind.startswith("json") else kind


def _response_format(rf: dict) -> list[Grammar]:
    kind = rf.get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":  # llama.cpp also takes a "schema" here
        schema = rf.get("schema")
        if schema is None:
            return [Grammar("json_object")]
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, 'response_format.json_schema must be an object: {"name": "...", "schema": {...}}',
                           "response_format")
        schema = spec.get("schema", {"type": "object"})
    else:
        raise APIError(400, f"response_format type {kind!r} is not supported: use text, json_object or "
                            "json_schema", "response_format")
    if not isinstance(schema, dict):
        raise APIError(400, "the JSON schema in response_format must be a JSON object", "response_format")
    return [Grammar.json_schema(schema)]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy API: a count of alternatives

    def logprobs_count(self) -> int | None:
        if self.logprobs is not None:
            return self.logprobs
        return self.n_probs

    @model_validator(mode="before")
    @classmethod
    def _prompt_shape(cls, data):
        """The prompt's shape checked by hand, once: left to the union of its four shapes, a long list of the
        wrong items would get an error per item and shape (millions for a 4 MB body)."""
        if isinstance(data, dict) and "prompt" in data and not _prompt_ok(data["prompt"]):
            raise APIError(400, f"invalid field 'prompt': it must be {SHAPES['prompt']}", "prompt")
        return data
    suffix: str | None = None
    best_of: int | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.echo:
            raise APIError(400, "echo is not supported: drop the echo field", "echo")
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", "best_of")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str | dict = "{}"  # OpenAI sends JSON text; some clients send the object


class ToolCallIn(_Strict):
    """An assistant's earlier tool call, in the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # streamed deltas carry it; clients sometimes send it back


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    # what clients send back when they append a response's message object as it came: all empty here
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list | None = None
    reasoning_content: str | None = None  # llama-server's thinking text: not part of the prompt

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict:
        """As chat templates expect it ("developer" is OpenAI's newer name for "system")."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # OpenAI's rule
    description: str = ""
    parameters: dict | None = None
    strict: bool | None = None  # OpenAI's opt-in: the schema is always enforced here


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedTool(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # llama-server's: extra variables for the chat template

    def template_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().requested_max_tokens()

    def logprobs_count(self) -> int | None:
        if self.logprobs:
            return self.top_logprobs or 0
        if self.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return self.n_probs

    def tool_list(self) -> list:
        """The tools (server/toolcalls.Tool), checked."""
        from quickdraft.errors import QuickdraftError
        from quickdraft.server.toolcalls import Tool, check_tools

        tools = [Tool(t.function.name, t.function.description,
                      t.function.parameters if t.function.parameters is not None else
                      {"type": "object", "properties": {}}) for t in self.tools or []]
        try:
            check_tools(tools)
        except QuickdraftError as e:
            raise APIError(400, say(e), "tools") from None
        return tools

    def tool_choice_name(self) -> str | None:
        """"auto" (the default with tools), "none", "required" or a function's name; None without tools."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools: send the functions in tools", "tool_choice")
            return None
        choice = self.tool_choice
        if isinstance(choice, NamedTool):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                               "tool_choice")
            return choice.function.name
        return choice or "auto"

    def check_fields(self) -> None:
        super().check_fields()
        if self.tools and (self.response_format not in (None, {"type": "text"}) or self.json_schema is not None
                           or self.grammar is not None or self.regex is not None):
            raise APIError(400, "tools and a response format (or grammar, regex) cannot be combined: the tool calls' "
                                "grammar is the constraint; send one or the other", "tools")
        for m in self.messages:
            if m.tool_calls and m.role != "assistant":
                raise APIError(400, "only an assistant message may hold tool_calls", "messages")
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, "a tool message needs the tool_call_id of the call it answers", "messages")


def _prompt_ok(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list):
        return False
    if all(isinstance(x, str) for x in prompt) or all(_is_int(x) for x in prompt):
        return True
    return all(isinstance(x, list) and all(_is_int(t) for t in x) for x in prompt)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- responses --------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_n: int, completion_n: int) -> dict:
    return {"prompt_tokens": prompt_n, "completion_tokens": completion_n, "total_tokens": prompt_n + completion_n}


def timings(t: Timings, stats: SpeculationStats, completion_n: int) -> dict:
    """llama.cpp's timings fields (prompt_*, predicted_*, draft_n, draft_n_accepted), then ours."""
    prompt_ms, predicted_ms = 1000 * t.prefill_s, 1000 * t.decode_s
    prefilled = t.prompt_n - t.cache_n
    return {
        "cache_n": t.cache_n,  # as llama-server: prompt tokens a kept slot held (not prefilled again)
        "prompt_n": prefilled,  # and those prefilled
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prefilled if prefilled else 0.0,
        "prompt_per_second": t.prefill_tok_s,
        "predicted_n": completion_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / t.n_decoded if t.n_decoded else 0.0,
        "predicted_per_second": t.decode_tok_s,
        "draft_n": stats.draft_n,
        "draft_n_accepted": stats.draft_n_accepted,
        "ttft_ms": 1000 * t.ttft_s,
        "draft_prefill_ms": 1000 * t.draft_prefill_s,
        "drafter": stats.drafter,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "accept_per_position": stats.accept_per_position,
        "rounds": stats.rounds,
        "plain_steps": stats.plain_steps,
        "k_mean": stats.k_mean,
        "k_history": stats.k_history,
        "constraint": stats.constraint,
        "mask_ms": 1000 * stats.mask_s,
        "mask_share": stats.mask_share,
        "tree_rounds": stats.tree_rounds,
        "tree_alternatives_kept": stats.tree_alternatives_kept,
        "tree_note": stats.tree_note,
        "by_source": stats.by_source(),  # per source: rounds, drafted, accepted, acceptance, mean accepted length
    }
