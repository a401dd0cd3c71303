"""The OpenAI wire format: request bodies (validated strictly) and the response objects built from events.

Request fields follow OpenAI's names (structured output by `response_format`); ours are `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, a `speculative` object, and `grammar` / `regex` constraints. Features we do not implement (n > 1, logprobs, tools, logit_bias, ...) are refused
with a 400 that says so, never silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from quickdraft.engine import Timings
from quickdraft.grammar import Grammar
from quickdraft.speculative.stats import SpeculationStats

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # a stop string's length (matching is linear in it: server/stops.py)
MAX_ITEMS = 4096  # items of any list or object in a body: messages, content parts, stop strings, tools, ...
MAX_PROMPT_ITEMS = 1 << 17  # token ids of a prompt given as ids (a context is never larger)
MAX_DEPTH = 64  # objects and lists within each other


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "0.5" is not a temperature; no NaN or infinity anywhere
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class Speculative(_Strict):
    """Per-request speculation: {"draft_max": 0} turns it off; {"draft_max": 4, "adaptive": false} fixes k."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    draft_max: int | None = Field(None, ge=0, le=63)
    draft_min: int | None = Field(None, ge=0, le=63)
    adaptive: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, lt=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: Speculative | None = None
    # refused unless left at their "off" values
    logprobs: bool | int | None = None
    logit_bias: dict | None = None
    tools: list | None = None
    # structured output: at most one of these
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...} as OpenAI's
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

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, "n other than 1 is not supported: send one request per completion", "n")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported: drop the logprobs field", "logprobs")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported: drop the field", "logit_bias")
        if self.tools:
            raise APIError(400, "tool calls are not supported: drop the tools field", "tools")

    def requested_grammar(self) -> Grammar | None:
        """The constraint the request asks for (compiled later: an invalid one is a 400 with its message)."""
        asked = []
        if self.response_format is not None:
            asked += _response_format(self.response_format)
        if self.grammar is not None:
            asked.append(Grammar("grammar", self.grammar))
        if self.regex is not None:
            asked.append(Grammar("regex", self.regex))
        if len(asked) > 1:
            raise APIError(400, "give at most one of response_format (json_object or json_schema), grammar "
                                "and regex", "response_format")
        return asked[0] if asked else None


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

    @model_validator(mode="before")
    @classmethod
    def _prompt_shape(cls, data):
        """The prompt's shape checked by hand, once: left to the union of its four shapes, a long list of the
        wrong items would get an error per item and shape (millions for a 4 MB body)."""
        if isinstance(data, dict) and "prompt" in data and not _prompt_ok(data["prompt"]):
            raise APIError(400, f"invalid field 'prompt': it must be {_SHAPES['prompt']}", "prompt")
        return data
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported: drop the echo field", "echo")
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", "best_of")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)

    def template_messages(self) -> list[dict]:
        """Messages as chat templates expect them ("developer" is OpenAI's newer name for "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


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


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes of a request body -> a validated request, or an APIError saying what to fix."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}): send UTF-8 JSON") from None
    if not text.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests lists or objects too deeply: at most {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    _check_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(400, *_describe(e)) from None


def _check_values(body: dict) -> None:
    """Bound a body's shape before validating it (the cost of validation and of its errors grows with it), and
    refuse text that is not Unicode: JSON allows an unpaired UTF-16 surrogate ("\\ud800"), which no tokenizer
    or encoder takes."""
    stack = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise APIError(400, f"field {where!r} nests lists or objects too deeply: at most {MAX_DEPTH} levels",
                           where.split(".")[0] or None)
        limit = MAX_PROMPT_ITEMS if where.split(".")[0] == "prompt" else MAX_ITEMS
        if len(value) > limit:
            raise APIError(400, f"field {where or 'body'!r} has {len(value)} items: at most {limit} are accepted",
                           where or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, f"{where}.{key}" if where else key)
            if isinstance(item, (str, dict, list)):
                stack.append((item, f"{where}.{key}" if where else str(key), depth + 1))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"field {where!r} holds an unpaired UTF-16 surrogate ({text[e.start]!r} at character "
                            f"{e.start}), which is not Unicode text: send valid UTF-8", where or None) from None


# What a field of several accepted shapes should be, said once instead of once per shape.
_SHAPES = {
    "prompt": "a string, a list with one string, or a list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "logprobs": "false",
}


def _describe(e: ValidationError) -> tuple[str, str]:
    """The first problem of a validation error as (message, field path)."""
    def path(loc) -> str:  # union members appear in loc as type names ("str", "list[int]"): drop them
        return ".".join(str(x) for x in loc if isinstance(x, int) or not _is_type_name(x)) or "body"

    first = e.errors()[0]
    where = path(first["loc"])
    field = where.rsplit(".", 1)[-1]
    if first["type"] == "missing":
        message = f"missing required field {where!r}"
    elif field in _SHAPES and len(first["loc"]) > len(where.split(".")):
        message = f"invalid field {where!r}: it must be {_SHAPES[field]}"
    elif first["type"] == "extra_forbidden":
        message = f"unknown field {where!r}"
    else:
        message = f"invalid field {where!r}: {first['msg']}"
    others = {o for o in (path(err["loc"]) for err in e.errors()) if o != where and not o.startswith(where + ".")}
    if others:
        message += f" (also: {', '.join(sorted(others)[:3])}{', ...' if len(others) > 3 else ''})"
    return message, where


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


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
    return {
        "prompt_n": t.prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / t.prompt_n if t.prompt_n else 0.0,
        "prompt_per_second": t.prefill_tok_s,
        "predicted_n": completion_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / t.n_decoded if t.n_decoded else 0.0,
        "predicted_per_second": t.decode_tok_s,
        "draft_n": stats.draft_n,
        "draft_n_accepted": stats.draft_n_accepted,
        "ttft_ms": 1000 * t.ttft_s,
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
    }
