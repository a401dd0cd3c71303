"""From a request to what the engine runs: the body read within a deadline, the prompt tokenised off the event loop
and within bounds, the sampling and speculation settings, and the constraint compiled in the sandbox.

Nothing here may hold the event loop (every other client's requests, /health) for long: text is bounded before it
is tokenised, and tokenising, chat templating and compiling run on other threads or in the sandbox's process.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace

from starlette.requests import ClientDisconnect, Request

from quickdraft.config import SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.server import bodies
from quickdraft.server import protocol as p
from quickdraft.server.sandbox import CompilerBusy, CompilerUnavailable

MAX_BODY_BYTES = 8 << 20
BODY_TIMEOUT_S = 60.0  # for the whole body, once its head has arrived (server/connections.py)


class ClientGone(Exception):
    """The client went away before its request was answered: nothing to send, nothing to log."""


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise p.APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise p.APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    except TimeoutError:
        raise p.APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


async def parse(request: Request, model):
    """The body read and validated (bodies.parse_body) on another thread. json.loads and validation hold the GIL
    for most of it, so a large body still slows the event loop (every other client, /health), but in the switch
    intervals Python gives threads it is not stopped for the whole second that 8 MiB of JSON takes."""
    return await asyncio.to_thread(bodies.parse_body, await read_body(request), model)


def check_model(state, req) -> None:
    """The model a request names: the served one by any of its names; another name is answered by the served model
    too (clients hard-code names), and the response's `model` says which, unless the server was started with
    --strict-model-name."""
    if req.model is not None and req.model not in state.names:
        if state.strict_model_name:
            raise p.APIError(404, f"model {req.model!r} is not served here: use {state.model_id!r} "
                                  "(see GET /v1/models)", "model", code="model_not_found")
        state.note_other_name(req.model)
    req.check_fields()


def _max_chars(state) -> int:
    """The most characters a prompt that fits the context can have: no token stands for more than the longest
    token's characters. Longer text is refused before it is tokenised."""
    return state.engine.context * state.engine.target.tokenizer.max_token_chars


def _check_chars(state, chars: int, field: str, what: str | None = None) -> None:
    """what: the text counted, where it is more than `field` (then the largest part of it, which the error names)."""
    limit = _max_chars(state)
    if chars > limit:
        raise p.APIError(400, f"{what or field} holds {chars} characters: more than the context of "
                              f"{state.engine.context} tokens can hold (at most {limit}); shorten it", field,
                         code="context_length_exceeded")


async def completion_prompt(state, req: p.CompletionRequest) -> list[int]:
    prompt, tokenizer = req.prompt, state.engine.target.tokenizer
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.APIError(400, "only one prompt per request is supported: send one request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_chars(state, len(prompt), "prompt")
        return await asyncio.to_thread(tokenizer.encode, prompt)
    vocab = state.engine.vocab
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise p.APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
    return list(prompt)


async def chat_prompt(state, req: p.ChatRequest, tools: "ToolPlan | None") -> list[int]:
    messages = req.template_messages()
    _check_template_chars(state, messages, tools, req.chat_template_kwargs)
    tokenizer = state.engine.target.tokenizer
    extra = dict(req.chat_template_kwargs or {})
    if tools is not None:
        messages = tools.format.messages(messages, tools.tools)
        if tools.format.native:
            extra["tools"] = [t.spec() for t in tools.tools]
    return await asyncio.to_thread(_render, tokenizer, messages, extra, not state.special_tokens_in_messages)


def _check_template_chars(state, messages: list[dict], tools: "ToolPlan | None", variables: dict | None) -> None:
    """Everything a chat template may render, bounded before it renders: messages, the tools (descriptions too) and
    llama-server's chat_template_kwargs, each alone and all together (7 MB in a description had held the event loop
    for seconds and added 1 GB)."""
    chars = {"messages": sum(len(m["content"]) + sum(len(c["function"]["name"]) + len(str(c["function"]["arguments"]))
                                                     for c in m.get("tool_calls", [])) for m in messages),
             "tools": sum(len(t.name) + len(t.description) + len(json.dumps(t.parameters)) for t in tools.tools)
             if tools else 0,
             "chat_template_kwargs": len(json.dumps(variables)) if variables else 0}
    for field, n in chars.items():
        _check_chars(state, n, field)
    largest = max(chars, key=chars.get)
    _check_chars(state, sum(chars.values()), largest, f"what the chat template renders (messages, tools and "
                                                      f"chat_template_kwargs; most of it in {largest})")


def _render(tokenizer, messages: list[dict], extra: dict, literal: bool) -> list[int]:
    """literal: special-token text in the messages stays text (tokenizer.encode_chat)."""
    try:
        return tokenizer.encode_chat(messages, extra, literal_special_text=literal)
    except QuickdraftError as e:
        raise p.APIError(400, p.say(e), "messages") from None
    except Exception as e:  # the template's own raise_exception, or a template bug on odd input
        raise p.APIError(400, f"the model's chat template refused these messages: {e}", "messages") from None


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools: the model's format for them, the tools, and the choice ("auto", "none", "required" or a
    function's name)."""

    format: object  # server/toolcalls.ToolFormat
    tools: list
    choice: str
    parallel: bool

    def grammar(self):
        return self.format.grammar(self.tools, self.choice, self.parallel)


def tool_plan(state, req) -> ToolPlan | None:
    if not isinstance(req, p.ChatRequest):
        return None
    choice = req.tool_choice_name()
    if choice is None:
        return None
    from quickdraft.server import toolcalls

    fmt = state.tool_format
    if fmt is None:
        fmt = state.tool_format = toolcalls.detect(state.engine.target.tokenizer)
    return ToolPlan(fmt, req.tool_list(), choice, req.parallel_tool_calls)


def sampling(req, max_tokens: int) -> SamplingParams:
    window = req.penalty_window()
    penalties = dict(repetition_penalty=req.penalty_value(), presence_penalty=req.presence_penalty,
                     frequency_penalty=req.frequency_penalty)
    if window == 0 and (req.repeat_last_n == 0 or req.penalty_last_n == 0):  # llama-server: 0 turns them off
        penalties = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
        window = None
    try:
        return SamplingParams(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, **penalties,
            **({"repetition_window": window} if window is not None else {}), seed=req.seed, max_tokens=max_tokens,
            stop_at_eos=not req.ignore_eos, logprobs=req.logprobs_count(), post_sampling=req.post_sampling_probs,
        )
    except QuickdraftError as e:
        raise p.APIError(400, p.say(e)) from None


def speculation(state, req):
    if req.speculative is None:
        return None
    base, s = state.engine.speculation, req.speculative
    draft_max = base.draft_max if s.draft_max is None else s.draft_max
    draft_min = min(base.draft_min, draft_max) if s.draft_min is None else s.draft_min
    if draft_min > draft_max:
        raise p.APIError(400, "speculative.draft_min must be <= speculative.draft_max", "speculative")
    if draft_max > 0 and state.engine.drafter is None:
        raise p.APIError(400, "this server runs without a draft: start it with --draft to speculate, or "
                              "send speculative.draft_max 0", "speculative")
    adaptive = base.adaptive if s.adaptive is None else s.adaptive
    return replace(base, draft_max=draft_max, draft_min=draft_min, adaptive=adaptive,
                   tree=base.tree if s.tree is None else s.tree)


async def constraint(state, req, tools: ToolPlan | None = None):
    """The request's constraint compiled (checked in the sandbox, then built here off the event loop), or None."""
    grammar = tools.grammar() if tools is not None else req.requested_grammar()
    if grammar is None:
        return None
    field = "tools" if tools is not None else p.constraint_field(grammar.kind)
    try:
        compiled = await state.sandbox.compile(grammar) if state.sandbox is not None else None
        return await asyncio.to_thread(state.engine.grammars.constraint, grammar, compiled)
    except QuickdraftError as e:
        raise p.APIError(400, p.say(e), field) from None
    except CompilerUnavailable as e:  # not the client's fault: a 503 it may retry
        raise p.APIError(503, f"{e}; retry later", field, type="server_busy" if isinstance(e, CompilerBusy) else
                         "server_error", headers={"Retry-After": "2"}) from None


async def unless_disconnected(request: Request, work):
    """Await work (a coroutine) unless the client goes away first: then it is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
