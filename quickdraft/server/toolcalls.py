"""Tool calling: the model's own tool-call format, read from its chat template; a grammar that makes every call parse
and match its function's JSON schema; and the parse of the output back into text and calls.

A format knows three things: how the template wants tool calls and results in the history (arguments as objects),
what the model writes to call (a trigger, e.g. Qwen's `<tool_call>` token, then the call), and the grammar of that.
The grammar is Lark with inline JSON schemas (llguidance's), compiled and enforced like any other constraint, so
speculation stays on and exact: drafts are masked as for a JSON schema. With tool_choice "auto" the text before a
call is free and the trigger switches the grammar to the call; "required" and a named function allow calls only;
"none" allows text only (the trigger is forbidden).

Formats: hermes (`<tool_call>` JSON `</tool_call>`: Qwen 2.5 / 3, Hermes, SmolLM3), mistral (`[TOOL_CALLS]` then
a JSON list, as Mistral Nemo; or `name[ARGS]{...}` per call, as Mistral Small 3.2, Ministral 3, Devstral; with
`[CALL_ID]` where the template has it), llama3 (a bare JSON object {"name", "parameters"}, Llama 3.1-3.3), and
generic for every other template: the tools are described in a system message and the answer is JSON,
{"tool_calls": [...]} or {"response": "..."} (as llama.cpp's generic format).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from quickdraft.errors import QuickdraftError
from quickdraft.grammar import JSON_WHITESPACE, Grammar

MAX_TOOLS = 128
# how an answer that is a bare or fenced JSON call opens (regexes)
LOOSE_OPENING = r'[ \n]*(```json[ \n]*)?\{[ \n]*"name"'
LOOSE_FENCED = r'[ \n]*```json[ \n]*\{[ \n]*"name"[ \n]*:'
LOOSE_BARE = r'[ \n]*\{[ \n]*"name"[ \n]*:'


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def spec(self) -> dict:
        """As OpenAI sends it, and chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI gives it
    id: str = ""

    def to_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id(length: int = 9) -> str:
    """A call id: 9 letters and digits (Mistral's templates insist on that shape; any client takes it)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(length))


# ---- formats ------------------------------------------------------------------------------------------------

class ToolFormat:
    """One model family's way to write tool calls (see the module's note)."""

    name = "?"
    triggers: tuple[str, ...] = ()  # text that starts a call: streamed text holds back what may become one
    native = True  # the chat template itself describes the tools (generic: quickdraft does)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    # the history, as the template wants it
    def messages(self, messages: list[dict], tools: list[Tool]) -> list[dict]:
        return [_template_shape(m, messages) for m in messages]

    # the constraint
    def grammar(self, tools: list[Tool], choice: str | None, parallel: bool) -> Grammar:
        """choice: "auto", "none", "required" or a function's name."""
        raise NotImplementedError

    # the output
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The generated text -> (content, calls); text that holds no call is all content."""
        raise NotImplementedError

    # shared pieces
    def _mark(self, text: str) -> str:
        """A fixed piece of the format in Lark: the special token when the vocabulary has it as one (llguidance takes
        added tokens only as themselves, never spelled out), else the string."""
        i = self.tokenizer.backend.token_to_id(text)
        if i is not None and i in self.tokenizer.backend.get_added_tokens_decoder():
            return f"<[{i}]>"
        return json.dumps(text)

    def _text_rule(self, loose: bool = False) -> str:
        """TEXT: any text that holds no trigger (and, loose, does not open with a bare or fenced JSON call)."""
        rule = "TEXT: /(?s:.*)/"
        spelled = [t for t in self.triggers if not self._mark(t).startswith("<[")]
        if spelled:
            banned = "|".join(re.escape(t) for t in spelled)
            rule += f" & ~/(?s:.*)({_lark_regex(banned)})(?s:.*)/"
        if loose:
            rule += f" & ~/{LOOSE_OPENING}(?s:.*)/"
        return rule


def _lark_regex(pattern: str) -> str:
    return pattern.replace("/", "\\/")


def _json(schema: dict, defs: dict | None = None) -> str:
    """An inline JSON schema for Lark, with the whitespace of every other JSON constraint; defs: definitions that
    its references point to (_Scope)."""
    if defs:
        schema = {**schema, "$defs": {**schema.get("$defs", {}), **defs}}
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


class _Scope:
    """Tools' parameters placed inside a larger schema (the call's object). Their references ("#/$defs/Step", "#":
    Pydantic's and agent frameworks' schemas) point into the parameters, as OpenAI resolves them, not into the
    object quickdraft wraps them in: parameters that refer are moved into the larger schema's $defs (`defs`, for
    _json), their references rebased."""

    def __init__(self):
        self.defs: dict[str, dict] = {}

    def place(self, parameters: dict) -> dict:
        """What to put where the parameters go: themselves, or a reference to their definition."""
        key = f"tool_parameters_{len(self.defs)}"
        rebased = _rebased(parameters, f"#/$defs/{key}")
        if rebased == parameters:  # no local reference
            return parameters
        self.defs[key] = rebased
        return {"$ref": f"#/$defs/{key}"}


_INSTANCES = frozenset({"const", "enum", "default", "examples", "example"})  # keywords whose values are data
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema, base: str):
    """A schema with each local reference ("#..." in a "$ref") made relative to base instead of the document's root.
    Data is left as it is (a "$ref" inside a const or an enum is a value), while maps of schemas are entered
    whatever their names (a property may be called "default")."""
    if isinstance(schema, list):  # allOf, anyOf, prefixItems, ...
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _INSTANCES:
            out[k] = v
        elif k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rebased(s, base) for name, s in v.items()}
        else:
            out[k] = _rebased(v, base)
    return out


def _object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _chosen(tools: list[Tool], choice: str | None) -> list[Tool]:
    if choice in (None, "auto", "required", "none"):
        return tools
    return [t for t in tools if t.name == choice]


def _calls_rule(one: str, parallel: bool, separator: str = "") -> str:
    return f"calls: {one}" if not parallel else f"calls: {one} ({separator} {one})*" if separator else \
        f"calls: {one}+"


def _start(choice: str | None, calls: str = "calls", trailing: str = "WS") -> str:
    if choice == "none":
        return "start: TEXT"
    if choice == "auto" or choice is None:
        return f"start: TEXT | TEXT {calls} {trailing}"
    return f"start: {calls} {trailing}"


class Hermes(ToolFormat):
    """`<tool_call>` {"name", "arguments"} `</tool_call>`. Small models often write the JSON bare or in a ```json
    fence instead: with tool_choice "auto" an answer that opens so is held to the schema and read as a call too
    (text that merely contains JSON elsewhere stays text)."""

    name = "hermes"
    triggers = ("<tool_call>",)

    def grammar(self, tools, choice, parallel):
        scope = _Scope()
        schemas = [_object({"name": {"const": t.name}, "arguments": scope.place(t.parameters)}, ["name", "arguments"])
                   for t in _chosen(tools, choice)]
        open_, close = self._mark("<tool_call>"), self._mark("</tool_call>")
        body = _json({"anyOf": schemas}, scope.defs)
        auto = choice in ("auto", None)
        start = _start(choice) + (" | loose WS" if auto else "")
        lines = ["%llguidance {}", start, _calls_rule("call", parallel, '"\\n"'),
                 f'call: {open_} "\\n" {body} "\\n" {close}', self._text_rule(loose=auto), "WS: /[ \\n]{0,4}/"]
        if auto:  # the object written out up to its arguments: a JSON subgrammar cannot start where TEXT may
            named = " | ".join(f'{json.dumps(json.dumps(t.name))} J "," J "\\"arguments\\"" J ":" J {_json(t.parameters)}'
                               for t in _chosen(tools, choice))
            lines += ["loose: FENCED J loose_body J \"}\" J \"```\" | BARE J loose_body J \"}\"",
                      f"loose_body: {named}", f"FENCED: /{LOOSE_FENCED}/", f"BARE: /{LOOSE_BARE}/",
                      f"J: /{JSON_WHITESPACE}/"]
        return Grammar("grammar", "\n".join(lines))

    def parse(self, text):
        calls, content = [], text
        pattern = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
        found = list(pattern.finditer(text))
        for m in found:
            call = _parse_object(m.group(1), "arguments")
            if call is None:
                return text, []
            calls.append(call)
        if found:
            return text[:found[0].start()].strip(), calls
        loose = re.fullmatch(r"\s*(?:```json\s*)?(\{.*\})\s*(?:```)?\s*", text, re.S)
        if loose and re.match(LOOSE_OPENING, text):
            call = _parse_object(loose.group(1), "arguments")
            if call is not None:
                return "", [call]
        return content, []


class Llama3(ToolFormat):
    """{"name": ..., "parameters": {...}} as the whole answer (Llama 3.1's custom tools: one call a turn)."""

    name = "llama3"
    triggers = ("{",)

    def grammar(self, tools, choice, parallel):
        scope = _Scope()
        schemas = [_object({"name": {"const": t.name}, "parameters": scope.place(t.parameters)}, ["name", "parameters"])
                   for t in _chosen(tools, choice)]
        lines = ["%llguidance {}", f"call: {_json({'anyOf': schemas}, scope.defs)}"]
        if choice == "none":
            lines.append("start: TEXT")
        elif choice in ("auto", None):
            lines.append("start: TEXT | call")
        else:
            lines.append("start: call")
        lines.append("TEXT: /([^{](?s:.*))?/")  # an answer that is not a call does not start with {
        return Grammar("grammar", "\n".join(lines))

    def parse(self, text):
        stripped = text.strip()
        if stripped.startswith("{"):
            call = _parse_object(stripped, "parameters")
            if call is not None:
                return "", [call]
        return text, []


class Mistral(ToolFormat):
    """[TOOL_CALLS] then, by template: a JSON list of {"name", "arguments", "id"} (Nemo), or per call
    `name[ARGS]{...}` (Small 3.2 adds `[CALL_ID]id` before [ARGS])."""

    name = "mistral"
    triggers = ("[TOOL_CALLS]",)

    def __init__(self, tokenizer, style: str):
        super().__init__(tokenizer)
        self.style = style  # "list", "args" or "call_id"

    def grammar(self, tools, choice, parallel):
        chosen, mark = _chosen(tools, choice), self._mark("[TOOL_CALLS]")
        lines = ["%llguidance {}"]
        if self.style == "list":
            scope = _Scope()
            items = [_object({"name": {"const": t.name}, "arguments": scope.place(t.parameters),
                              "id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}, ["name", "arguments", "id"])
                     for t in chosen]
            lst = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
            if not parallel:
                lst["maxItems"] = 1
            lines.append(f"calls: {mark} {_json(lst, scope.defs)}")
        else:
            args = self._mark("[ARGS]")
            call_id = f' {self._mark("[CALL_ID]")} /[A-Za-z0-9]{{9}}/' if self.style == "call_id" else ""
            alternatives = " | ".join(f"{json.dumps(t.name)}{call_id} {args} {_json(t.parameters)}" for t in chosen)
            lines += [f"call: {mark} ({alternatives})", _calls_rule("call", parallel)]
        lines += [_start(choice, trailing=""), self._text_rule()]
        return Grammar("grammar", "\n".join(lines))

    def parse(self, text):
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        content, rest = text[:at].strip(), text[at:]
        calls = []
        if self.style == "list":
            try:
                items = json.loads(rest[len("[TOOL_CALLS]"):].strip())
            except json.JSONDecodeError:
                return text, []
            for item in items if isinstance(items, list) else []:
                call = _call_from(item, "arguments")
                if call is None:
                    return text, []
                calls.append(call)
            return content, calls
        for piece in rest.split("[TOOL_CALLS]")[1:]:
            head, sep, args = piece.partition("[ARGS]")
            name, _, call_id = head.partition("[CALL_ID]")
            try:
                value = json.loads(args.strip()) if sep else None
            except json.JSONDecodeError:
                return text, []
            if not isinstance(value, dict):
                return text, []
            calls.append(ToolCall(name.strip(), json.dumps(value, ensure_ascii=False), call_id.strip()))
        return content, calls


class Generic(ToolFormat):
    """For templates without tools: the tools in a system message, the answer a JSON object."""

    name = "generic"
    native = False

    def messages(self, messages, tools):
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}
                         for c in m["tool_calls"]]
                out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
            elif m["role"] == "tool":
                result = json.dumps({"tool_response": {"name": _name_of_call(m, messages), "content": m["content"]}},
                                    ensure_ascii=False)
                if out and out[-1]["role"] == "user":  # templates that insist on alternating turns
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
                else:
                    out.append({"role": "user", "content": result})
            else:
                out.append({"role": m["role"], "content": m.get("content") or ""})
        if tools:
            described = "\n".join(json.dumps(t.spec()["function"], ensure_ascii=False) for t in tools)
            note = ("You can call these tools (function signatures as JSON):\n" + described + "\n\nTo call tools, "
                    'answer with a JSON object {"tool_calls": [{"name": "<function name>", "arguments": {...}}]}; '
                    'to answer directly, with {"response": "<your answer>"}.')
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out

    def grammar(self, tools, choice, parallel):
        scope = _Scope()
        items = [_object({"name": {"const": t.name}, "arguments": scope.place(t.parameters)}, ["name", "arguments"])
                 for t in _chosen(tools, choice)]
        calls = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        with_calls = _object({"tool_calls": calls}, ["tool_calls"])
        answer = _object({"response": {"type": "string"}}, ["response"])
        schema = answer if choice == "none" else {"anyOf": [with_calls, answer]} if choice in ("auto", None) \
            else with_calls
        return Grammar("grammar", f"%llguidance {{}}\nstart: {_json(schema, scope.defs)}")

    def parse(self, text):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            calls = [_call_from(item, "arguments") for item in value["tool_calls"]]
            if calls and all(calls):
                return "", calls
        return text, []


def detect(tokenizer) -> ToolFormat:
    """The format the model's chat template writes tool calls in (generic when it has none we parse)."""
    template = tokenizer.chat_template or ""
    if "<function=" in template:  # Qwen3-Coder / Qwen3.5's XML calls: parameters as text, not JSON
        return Generic(tokenizer)
    if "<tool_call>" in template:
        return Hermes(tokenizer)
    if "[TOOL_CALLS]" in template:
        style = "call_id" if "[CALL_ID]" in template else "args" if "[ARGS]" in template else "list"
        return Mistral(tokenizer, style)
    if '"parameters": dictionary of argument name' in template:
        return Llama3(tokenizer)
    return Generic(tokenizer)


# ---- the history and the output -----------------------------------------------------------------------------

def _template_shape(message: dict, messages: list[dict]) -> dict:
    """A message as chat templates want it: tool-call arguments as objects (templates tojson them), a tool result
    with the name of the call it answers."""
    out = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments_object(
            c["function"]["arguments"])}} for c in message["tool_calls"]]
    if message["role"] == "tool" and not message.get("name"):
        out["name"] = _name_of_call(message, messages)
    return out


def _arguments_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _name_of_call(tool_message: dict, messages: list[dict]) -> str:
    wanted = tool_message.get("tool_call_id")
    for m in messages:
        for c in m.get("tool_calls") or []:
            if c.get("id") == wanted:
                return c["function"]["name"]
    return tool_message.get("name") or ""


def _parse_object(text: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_from(value, arguments_key)


def _call_from(value, arguments_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), str(value.get("id") or ""))


class ToolStream:
    """Streams a tool-calling generation's text: content as it comes, held back from where a call may begin (a
    trigger, or the start of one at the end of the text so far); the calls once the output is complete."""

    def __init__(self, fmt: ToolFormat, choice: str | None = "auto"):
        self.fmt = fmt
        # tool_choice "none": whatever the text holds is text (a bare JSON call written as an answer too)
        self.text_only = choice == "none" and fmt.native
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.calling = False

    def push(self, piece: str) -> str:
        """Content to stream now."""
        self.text += piece
        if self.text_only:
            self.sent = len(self.text)
            return piece
        if self.calling or not self.fmt.native:  # generic: the whole answer is JSON, parsed at the end
            return ""
        starts = [i for t in self.fmt.triggers if (i := self.text.find(t, self.sent)) >= 0]
        if isinstance(self.fmt, Llama3):  # a call is the whole answer: held back until it cannot be one
            if not self.text.strip():
                return ""
            if self.text.lstrip().startswith("{"):
                self.calling = True
                return ""
            starts = []
        elif isinstance(self.fmt, Hermes) and self.sent == 0:  # an answer that may open as a bare or fenced call
            if re.match(LOOSE_OPENING, self.text):
                self.calling = True
                return ""
            if _could_open_loose(self.text):
                return ""
        if starts:
            self.calling = True
            end = min(starts)
        else:
            end = len(self.text) - _partial_trigger(self.text, self.fmt.triggers)
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet streamed, calls) once the generation has ended."""
        if self.text_only:
            return "", []
        content, calls = self.fmt.parse(self.text)
        calls = [c if c.id else ToolCall(c.name, c.arguments, new_call_id()) for c in calls]
        if calls:
            rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
            return rest, calls
        return self.text[self.sent:] if self.fmt.native else content, []


def _could_open_loose(text: str) -> bool:
    """Whether more text could still make text open as LOOSE_OPENING does."""
    rest = text.lstrip(" \n")
    if rest.startswith("```json"):
        rest = rest[len("```json"):].lstrip(" \n")
    elif "```json".startswith(rest):
        return True
    if not rest:
        return True
    if not rest.startswith("{"):
        return False
    rest = rest[1:].lstrip(" \n")
    return '"name"'.startswith(rest)


def _partial_trigger(text: str, triggers) -> int:
    """How many characters at the end of text could be the start of a trigger."""
    best = 0
    for t in triggers:
        for n in range(min(len(t) - 1, len(text)), 0, -1):
            if text.endswith(t[:n]):
                best = max(best, n)
                break
    return best


def check_tools(tools: list[Tool]) -> None:
    """How many tools (each is a branch of the calls' grammar), and distinct names; QuickdraftError says what to do."""
    if len(tools) > MAX_TOOLS:
        raise QuickdraftError(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}: send fewer")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise QuickdraftError("two tools have the same name: give each function its own")
