"""The HTTP routes: parse a request, hand it to the engine worker, format its events as OpenAI does."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quickdraft.config import SamplingParams
from quickdraft.errors import QuickdraftError
from quickdraft.server import protocol as p
from quickdraft.server.metrics import Metrics
from quickdraft.server.worker import Done, EngineWorker, Failed, Job, Piece, QueueFull

MAX_BODY_BYTES = 8 << 20
log = logging.getLogger("quickdraft.server")


@dataclass
class ServerState:
    worker: EngineWorker
    model_id: str  # the name /v1/models lists
    model_aliases: frozenset[str]  # other names a request may use for it
    api_key: str | None = None

    @property
    def engine(self):
        return self.worker.engine

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield  # the worker runs from its construction
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="quickdraft", description="OpenAI-compatible API with exact speculative decoding",
                  lifespan=lifespan)
    app.state.quickdraft = state

    @app.exception_handler(p.APIError)
    async def api_error(request, e: p.APIError):
        state.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(p.APIError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):  # ours, not the client's: say so, keep serving
        log.exception("unexpected error on %s", request.url.path)
        body = p.APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if state.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                e = p.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")
                state.metrics.rejected.labels("401").inc()
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": state.worker.pending.qsize(),
                "running": state.worker.running is not None}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        engine = state.engine
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": p.now(), "owned_by": "quickdraft",
            "context_length": engine.context, "draft": engine.drafter_name,
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = p.parse_body(await _read_body(request), p.CompletionRequest)
        _check_request(state, req)
        prompt = _completion_prompt(state, req)
        return await _respond(state, request, req, prompt, chat=False, max_tokens=req.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = p.parse_body(await _read_body(request), p.ChatRequest)
        _check_request(state, req)
        tokenizer = state.engine.target.tokenizer
        try:
            text = tokenizer.apply_chat_template(req.template_messages())
        except QuickdraftError as e:
            raise p.APIError(400, str(e).replace("drop --chat and give a raw prompt",
                                                 "use /v1/completions with a raw prompt"), "messages") from None
        except Exception as e:  # the template's own raise_exception, or a template bug on odd input
            raise p.APIError(400, f"the model's chat template refused these messages: {e}", "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await _respond(state, request, req, tokenizer.encode(text), chat=True, max_tokens=max_tokens)

    return app


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise p.APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise p.APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
    return bytes(body)


def _check_request(state: ServerState, req) -> None:
    if req.model is not None and req.model not in state.model_aliases | {state.model_id}:
        raise p.APIError(404, f"model {req.model!r} is not served here: use {state.model_id!r} "
                              "(see GET /v1/models)", "model", code="model_not_found")
    req.refuse_unsupported()


def _completion_prompt(state: ServerState, req: p.CompletionRequest) -> list[int]:
    prompt, tokenizer = req.prompt, state.engine.target.tokenizer
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.APIError(400, "only one prompt per request is supported: send one request per prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab = state.engine.vocab
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise p.APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
    return list(prompt)


def _sampling(req, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, max_tokens=max_tokens,
            stop_at_eos=not req.ignore_eos,
        )
    except QuickdraftError as e:
        raise p.APIError(400, str(e)) from None


def _speculation(state: ServerState, req):
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
    return replace(base, draft_max=draft_max, draft_min=draft_min, adaptive=adaptive)


async def _constraint(state: ServerState, req):
    """The request's grammar compiled (off the event loop: a large schema takes a while), or None."""
    grammar = req.requested_grammar()
    if grammar is None:
        return None
    try:
        return await asyncio.to_thread(state.engine.constraint, grammar)
    except QuickdraftError as e:
        raise p.APIError(400, str(e), "response_format" if grammar.kind.startswith("json") else grammar.kind) from None


async def _respond(state: ServerState, request: Request, req, prompt: list[int], chat: bool,
                   max_tokens: int | None):
    context, field = state.engine.context, "messages" if chat else "prompt"
    if not prompt:
        raise p.APIError(400, "the prompt is empty: send some text", field)
    if len(prompt) >= context:
        raise p.APIError(400, f"the prompt ({len(prompt)} tokens) fills the context of {context} tokens: "
                              "shorten it", field, code="context_length_exceeded")
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = context - len(prompt)
    if len(prompt) + max_tokens > context:
        raise p.APIError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                              f"context of {context} tokens: shorten the prompt or lower max_tokens",
                         "max_tokens", code="context_length_exceeded")
    params, speculation, stops = _sampling(req, max_tokens), _speculation(state, req), req.stop_strings()
    constraint = await _constraint(state, req)
    job = Job(prompt, params, speculation, stops, asyncio.get_running_loop(), constraint)
    try:
        state.worker.submit(job)
    except QueueFull as full:
        raise p.APIError(503, "the server is busy: every queue slot is taken; retry later",
                         type="server_busy", headers={"Retry-After": str(full.retry_after_s)}) from None
    reply = _Reply(state, req, chat, len(prompt))
    if req.stream:
        return StreamingResponse(_stream(request, job, reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    pieces = []
    async with _watch_disconnect(request, job):
        while not isinstance(item := await job.events.get(), (Done, Failed)):
            pieces.append(item.text)
    if isinstance(item, Failed):
        raise p.APIError(500, item.message, type="server_error")
    return reply.whole("".join(pieces), item)


async def _stream(request: Request, job: Job, reply: "_Reply") -> AsyncIterator[str]:
    async with _watch_disconnect(request, job):
        if reply.chat:
            yield _sse(reply.chunk({"role": "assistant", "content": ""}))
        while True:
            item = await job.events.get()
            if isinstance(item, Piece):
                yield _sse(reply.chunk(item.text))
            elif isinstance(item, Failed):
                yield _sse(p.APIError(500, item.message, type="server_error").body())
                break
            else:
                yield _sse(reply.chunk(None, item))
                if reply.include_usage:
                    yield _sse({**reply.chunk(None), "choices": [], "usage": p.usage(reply.prompt_n, item.completion_n)})
                break
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@asynccontextmanager
async def _watch_disconnect(request: Request, job: Job):
    """Cancel the job as soon as the client goes away (or this coroutine is cancelled)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        job.cancel()  # no-op when the job has finished


class _Reply:
    """Builds the response objects of one request (ids and timestamps shared by all its chunks)."""

    def __init__(self, state: ServerState, req, chat: bool, prompt_n: int):
        self.chat, self.prompt_n, self.model = chat, prompt_n, state.model_id
        self.id = p.new_id("chatcmpl" if chat else "cmpl")
        self.created = p.now()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def _envelope(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def chunk(self, content, done: Done | None = None) -> dict:
        """A streamed chunk: content is a str (a piece of text), a dict (a chat delta) or None (final)."""
        finish = done.finish_reason if done else None
        if self.chat:
            delta = content if isinstance(content, dict) else ({} if content is None else {"content": content})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
            out = {**self._envelope("text_completion"), "choices": [choice]}
        if done:
            out["timings"] = p.timings(done.timings, done.stats, done.completion_n)
        return out

    def whole(self, text: str, done: Done) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": done.finish_reason}
            out = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
            out = self._envelope("text_completion")
        return {**out, "choices": [choice], "usage": p.usage(self.prompt_n, done.completion_n),
                "timings": p.timings(done.timings, done.stats, done.completion_n)}
