"""From a request body's bytes to a validated request (server/protocol.py's models): UTF-8, JSON, a shape within
bounds, no unpaired surrogates, and the first validation error said in one line.

The bounds come first because validating a body, and describing why it is invalid, costs per item: lists each within
their cap multiply (a 2 MB body of 512 messages x 1365 content parts had held the event loop 20 s), so the work is
bounded per body (MAX_VALUES), not only per list.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from quickdraft.server.protocol import SHAPES, APIError

MAX_ITEMS = 4096  # items of any list or object in a body: messages, content parts, stop strings, tools, ...
MAX_PROMPT_ITEMS = 1 << 17  # token ids of a prompt given as ids (a context is never larger)
MAX_DEPTH = 64  # objects and lists within each other
# items of all lists and objects of a body together: lists each within MAX_ITEMS multiply (4096 messages x 4096
# content parts), and validating, or describing why not, costs per item (~5 us to validate, ~20 us to describe an
# invalid one); at this bound a body is refused or validated in well under a second. A prompt's token ids are
# bounded apart (MAX_PROMPT_ITEMS in all its lists); anything else in a prompt counts here
MAX_VALUES = 1 << 16


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
    tally = _Tally()
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        top = where.split(".")[0]
        _check_container(value, where, top, depth)
        if top == "prompt":  # its token ids have their own bound; anything else in it counts as anywhere
            nested = sum(isinstance(item, (str, dict, list)) for item in value)
            tally.add("prompt", nested)
            tally.add_ids(len(value) - nested)
        else:
            tally.add(top or "body", len(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, f"{where}.{key}" if where else key)
            if isinstance(item, (str, dict, list)):
                stack.append((item, f"{where}.{key}" if where else str(key), depth + 1))


def _check_container(value: dict | list, where: str, top: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise APIError(400, f"field {where!r} nests lists or objects too deeply: at most {MAX_DEPTH} levels",
                       top or None)
    limit = MAX_PROMPT_ITEMS if top == "prompt" else MAX_ITEMS
    if len(value) > limit:
        raise APIError(400, f"field {where or 'body'!r} has {len(value)} items: at most {limit} are accepted",
                       where or None)


class _Tally:
    """What _check_values has walked: items of lists and objects under each top-level field (a prompt's token ids
    apart), each bounded over the whole body."""

    def __init__(self):
        self.values: dict[str, int] = {}
        self.ids = 0

    def add(self, field: str, n: int) -> None:
        self.values[field] = self.values.get(field, 0) + n
        if sum(self.values.values()) > MAX_VALUES:
            most = max(self.values, key=self.values.get)
            raise APIError(400, f"the request body holds more than {MAX_VALUES} values (items of its lists and "
                                f"objects; most of them under {most!r}): send fewer", None if most == "body" else most)

    def add_ids(self, n: int) -> None:
        self.ids += n
        if self.ids > MAX_PROMPT_ITEMS:
            raise APIError(400, f"the prompt holds more than {MAX_PROMPT_ITEMS} token ids in all its lists (a context "
                                "is never that long): send fewer", "prompt")


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"field {where!r} holds an unpaired UTF-16 surrogate ({text[e.start]!r} at character "
                            f"{e.start}), which is not Unicode text: send valid UTF-8", where or None) from None


def _describe(e: ValidationError) -> tuple[str, str]:
    """The first problem of a validation error as (message, field path)."""
    def path(loc) -> str:  # union members appear in loc as type names ("str", "list[int]"): drop them
        return ".".join(str(x) for x in loc if isinstance(x, int) or not _is_type_name(x)) or "body"

    errors = e.errors(include_url=False, include_context=False, include_input=False)  # inputs: a copy per error
    first = errors[0]
    where = path(first["loc"])
    field = where.rsplit(".", 1)[-1]
    if first["type"] == "missing":
        message = f"missing required field {where!r}"
    elif field in SHAPES and len(first["loc"]) > len(where.split(".")):
        message = f"invalid field {where!r}: it must be {SHAPES[field]}"
    elif first["type"] == "extra_forbidden":
        message = f"unknown field {where!r}"
    else:
        message = f"invalid field {where!r}: {first['msg']}"
    others = {o for o in (path(err["loc"]) for err in errors) if o != where and not o.startswith(where + ".")}
    if others:
        message += f" (also: {', '.join(sorted(others)[:3])}{', ...' if len(others) > 3 else ''})"
    return message, where


def _is_type_name(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
