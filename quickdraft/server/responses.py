"""Running a prepared request: a place in the queue, the job on the engine thread, and its events as OpenAI's
response objects (whole, or streamed over SSE)."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from quickdraft.server import protocol as p
from quickdraft.server import requests as prepare
from quickdraft.server.worker import Cancelled, Done, Failed, Job, Piece, QueueFull
from quickdraft.server.toolcalls import ToolStream


async def respond(state, request: Request, req, prompt: list[int], chat: bool, max_tokens: int | None, tools=None):
    context, field = state.engine.context, "messages" if chat else "prompt"
    if not prompt:
        raise p.APIError(400, "the prompt is empty: send some text", field)
    if len(prompt) >= context:
        most = state.engine.target.config.max_context
        raise p.APIError(400, f"the prompt ({len(prompt)} tokens) fills the context of {context} tokens: shorten it"
                         + (f" (the server's context: serve --ctx; the model takes up to {most})" if most > context
                            else ""), field, code="context_length_exceeded")
    # as OpenAI and llama-server: up to the end of the context, where max_tokens is left out or asks for more
    max_tokens = context - len(prompt) if max_tokens is None else min(max_tokens, context - len(prompt))
    params, speculation = prepare.sampling(req, max_tokens), prepare.speculation(state, req)
    stops = req.stop_strings()
    try:
        state.worker.check_room()  # a full queue is a 503 at once, not after compiling a constraint for nothing
        # compiled before it takes a place in the engine's queue: compiles wait for the compiler's lanes
        # (server/sandbox.py), and plain requests never wait for them
        constraint = await prepare.unless_disconnected(request, prepare.constraint(state, req, tools))
        ticket = state.worker.admit()
    except QueueFull as full:
        raise p.APIError(503, "the server is busy: every queue slot is taken; retry later",
                         type="server_busy", headers={"Retry-After": str(full.retry_after_s)}) from None
    job = Job(prompt, params, speculation, stops, asyncio.get_running_loop(), constraint, ticket,
              trace=req.speculation_trace, reuse=req.cache_prompt, scope=getattr(req, "user", None))
    state.worker.submit(job)
    reply = _Reply(state, req, chat, len(prompt), tools)
    if req.stream:
        return StreamingResponse(_stream(request, job, reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    pieces, scored, traced = [], [], []
    async with _watch_disconnect(request, job):
        while not isinstance(item := await job.events.get(), (Done, Failed, Cancelled)):
            pieces.append(item.text)
            scored += item.logprobs or []
            traced += item.trace or []
    if isinstance(item, Cancelled):
        raise prepare.ClientGone()
    if isinstance(item, Failed):
        raise _error(item)
    return reply.whole("".join(pieces), item, scored + (item.logprobs or []),
                       traced + (item.trace or []) if job.trace else None)


def _error(failed: Failed) -> p.APIError:
    kind = "server_error" if failed.status >= 500 else "invalid_request_error"
    return p.APIError(failed.status, failed.message, failed.param, type=kind)


async def _stream(request: Request, job: Job, reply: "_Reply") -> AsyncIterator[str]:
    calls = ToolStream(reply.tools.format, reply.tools.choice) if reply.tools is not None else None
    async with _watch_disconnect(request, job):
        if reply.chat:
            yield _sse(reply.chunk({"role": "assistant", "content": ""}))
        while True:
            item = await job.events.get()
            if isinstance(item, Piece):
                text = calls.push(item.text) if calls is not None else item.text
                if text or item.logprobs or item.trace:
                    yield _sse(reply.chunk(text, logprobs=item.logprobs, trace=item.trace))
            elif isinstance(item, Failed):
                yield _sse(_error(item).body())
                break
            elif isinstance(item, Cancelled):  # nobody is reading any more
                return
            else:
                finish = item.finish_reason
                if calls is not None:
                    rest, found = calls.finish()
                    if rest or item.logprobs or item.trace:
                        yield _sse(reply.chunk(rest, logprobs=item.logprobs, trace=item.trace))
                    if found:
                        yield _sse(reply.chunk({"tool_calls": [c.to_dict(i) for i, c in enumerate(found)]}))
                        finish = "tool_calls" if finish == "stop" else finish
                elif item.logprobs or item.trace:
                    yield _sse(reply.chunk("", logprobs=item.logprobs, trace=item.trace))
                yield _sse(reply.chunk(None, item, finish=finish))
                if reply.include_usage:
                    yield _sse({**reply.chunk(None), "choices": [], "usage": p.usage(reply.prompt_n, item.completion_n),
                                "timings": p.timings(item.timings, item.stats, item.completion_n)})
                break
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@asynccontextmanager
async def _watch_disconnect(request: Request, job: Job):
    """Cancel the job as soon as the client goes away (or this coroutine is cancelled), and end the wait for its
    events at once: a running job ends after its current token, a queued one only when the engine reaches it."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()
        job.events.put_nowait(Cancelled())

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        job.cancel()  # no-op when the job has finished


class _Reply:
    """Builds the response objects of one request (ids and timestamps shared by all its chunks)."""

    def __init__(self, state, req, chat: bool, prompt_n: int, tools=None):
        self.chat, self.prompt_n, self.model = chat, prompt_n, state.model_id
        self.tools = tools
        self.id = p.new_id("chatcmpl" if chat else "cmpl")
        self.created = p.now()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.offset = 0  # characters of text so far (the legacy logprobs' text_offset)

    def _envelope(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def chunk(self, content, done: Done | None = None, logprobs: list[dict] | None = None,
              finish: str | None = None, trace: list[dict] | None = None) -> dict:
        """A streamed chunk: content is a str (a piece of text), a dict (a chat delta) or None (final)."""
        finish = finish or (done.finish_reason if done else None)
        scored = self._logprobs(logprobs) if logprobs else None
        if self.chat:
            delta = content if isinstance(content, dict) else ({} if content is None else {"content": content})
            choice = {"index": 0, "delta": delta, "logprobs": scored, "finish_reason": finish}
            out = {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": scored, "finish_reason": finish}
            out = {**self._envelope("text_completion"), "choices": [choice]}
        if trace:  # speculation_trace: the tokens' origins (an extension OpenAI clients ignore)
            choice["trace"] = trace
        if done:
            out["timings"] = p.timings(done.timings, done.stats, done.completion_n)
        return out

    def whole(self, text: str, done: Done, logprobs: list[dict], trace: list[dict] | None = None) -> dict:
        scored = self._logprobs(logprobs) if logprobs else None
        finish = done.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.tools is not None:
                stream = ToolStream(self.tools.format, self.tools.choice)
                stream.push(text)
                content, calls = stream.finish()
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.to_dict() for c in calls]}
                    finish = "tool_calls" if finish == "stop" else finish
                elif not self.tools.format.native:
                    message["content"] = content
            choice = {"index": 0, "message": message, "logprobs": scored, "finish_reason": finish}
            out = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": scored, "finish_reason": finish}
            out = self._envelope("text_completion")
        if trace is not None:
            choice["trace"] = trace
        return {**out, "choices": [choice], "usage": p.usage(self.prompt_n, done.completion_n),
                "timings": p.timings(done.timings, done.stats, done.completion_n)}

    def _logprobs(self, entries: list[dict]) -> dict:
        """Token entries (worker.py) in the shape of this endpoint: chat's {"content": [...]}, or the legacy
        completions' parallel lists."""
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}
