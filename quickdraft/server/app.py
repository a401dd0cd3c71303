"""The HTTP routes: check who may ask, parse a request (server/requests.py), hand it to the engine worker and format
its events as OpenAI does (server/responses.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from quickdraft.server import protocol as p
from quickdraft.server import requests as prepare
from quickdraft.server.metrics import Metrics
from quickdraft.server.responses import respond
from quickdraft.server.sandbox import GrammarSandbox
from quickdraft.server.worker import EngineWorker

log = logging.getLogger("quickdraft.server")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# the chat page (server/page/): static files read once, served at / and /page/NAME without the API key (the
# page asks for the key and sends it with its API calls); nothing there comes from elsewhere
PAGE = Path(__file__).with_name("page")
PAGE_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
              ".css": "text/css; charset=utf-8"}
PAGE_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                           "connect-src 'self'; frame-ancestors 'none'"}


@dataclass
class ServerState:
    worker: EngineWorker
    model_id: str  # the name /v1/models lists
    model_aliases: frozenset[str]  # other names a request may use for it (--alias, the file's name)
    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = None  # Host header names answered (None: any); see check_host
    sandbox: GrammarSandbox | None = None  # where request constraints compile first (made at startup)
    strict_model_name: bool = False  # a request naming another model gets 404 (else the served model answers)
    cors_origins: tuple[str, ...] | None = None  # browser origins allowed besides loopback pages; ("*",): any
    # special-token text in a message becomes control tokens (llama-server's way); else it stays text, and no message
    # can forge a turn (tokenizer.encode_chat)
    special_tokens_in_messages: bool = False
    api_docs: bool = False  # FastAPI's /docs, /redoc and /openapi.json (their pages load scripts from a public CDN)
    tool_format: object | None = None  # the model's tool-call format (server/toolcalls.py), found on first use
    other_names: set[str] = field(default_factory=set)  # names requests used that are not the model's
    created: int = field(default_factory=p.now)

    @property
    def names(self) -> frozenset[str]:
        return self.model_aliases | {self.model_id}

    def note_other_name(self, name: str) -> None:
        """Say once per name, on the console, that requests naming another model get this one."""
        if name not in self.other_names and len(self.other_names) < 64:
            self.other_names.add(name)
            log.warning("requests name model %r: %s answers them (start with --strict-model-name to refuse)",
                        name[:100], self.model_id)

    @property
    def engine(self):
        return self.worker.engine

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        tokenizer = state.engine.target.tokenizer
        if state.sandbox is None:
            state.sandbox = GrammarSandbox(tokenizer.backend.to_str(), state.engine.vocab, sorted(tokenizer.eos_ids))
        starting = asyncio.create_task(_start(state.sandbox))  # the first constrained request would wait for it
        yield  # the worker runs from its construction
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)  # a child cancelled while it starts is killed
        await state.sandbox.close()
        await asyncio.to_thread(state.worker.stop)

    docs = {} if state.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="quickdraft", description="OpenAI-compatible API with exact speculative decoding",
                  lifespan=lifespan, **docs)
    app.state.quickdraft = state
    _errors(app, state)
    _guards(app, state)

    page = {f.name: (f.read_bytes(), PAGE_TYPES[f.suffix]) for f in PAGE.iterdir() if f.suffix in PAGE_TYPES}

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return Response(page["index.html"][0], media_type=page["index.html"][1], headers=PAGE_HEADERS)

    @app.get("/page/{name}", include_in_schema=False)
    async def page_file(name: str):
        if name not in page:
            raise p.APIError(404, f"no page file {name!r}", code="not_found")
        return Response(page[name][0], media_type=page[name][1], headers=PAGE_HEADERS)

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": state.worker.held, "running": len(state.worker.running)}

    @app.get("/metrics")
    async def metrics():
        state.metrics.tasks.set(len(asyncio.all_tasks()))
        state.metrics.compiles.set(len(state.sandbox.compiling) if state.sandbox is not None else 0)
        slots = state.engine.slots
        state.metrics.cache_evictions.set(slots.evicted + slots.dropped)
        state.metrics.cache_bytes.set(slots.used_bytes())
        if slots.host is not None:
            m, host = state.metrics, slots.host
            m.host_stored.set(host.stored)
            m.host_restored.set(host.restored)
            m.host_damaged.set(host.damaged)
            m.host_bytes.set(host.nbytes())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/slots")
    async def slots():
        """The kept slots, as llama-server's GET /slots: which run a request, how many tokens each holds."""
        return state.engine.slots.view()

    def model_card(name: str) -> dict:
        engine = state.engine
        return {"id": name, "object": "model", "created": state.created, "owned_by": "quickdraft",
                "context_length": engine.context, "draft": engine.drafter_name, "served_as": state.model_id}

    @app.get("/v1/models")
    async def models():
        names = [state.model_id] + sorted(state.model_aliases - {state.model_id})
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in state.names:
            raise p.APIError(404, f"model {name!r} is not served here: this server serves {state.model_id!r}",
                             "model", code="model_not_found")
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await prepare.parse(request, p.CompletionRequest)
        prepare.check_model(state, req)
        prompt = await prepare.completion_prompt(state, req)
        return await respond(state, request, req, prompt, chat=False, max_tokens=req.requested_max_tokens())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await prepare.parse(request, p.ChatRequest)
        prepare.check_model(state, req)
        tools = prepare.tool_plan(state, req)
        prompt = await prepare.chat_prompt(state, req, tools)
        return await respond(state, request, req, prompt, chat=True, max_tokens=req.requested_max_tokens(),
                             tools=tools)

    return app


async def _start(sandbox: GrammarSandbox) -> None:
    try:
        await sandbox.start()
    except Exception as e:  # noqa: BLE001 - plain requests are unaffected; constrained ones get the message
        log.warning("the grammar compiler did not start: %s", e)


def _errors(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(p.APIError)
    async def api_error(request, e: p.APIError):
        state.metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(p.APIError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(prepare.ClientGone)
    async def client_gone(request, e):  # nobody to answer
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):  # ours, not the client's: say so, keep serving
        log.exception("unexpected error on %s", request.url.path)
        body = p.APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body()
        return JSONResponse(body, status_code=500)


# pages served from this machine (any port): allowed to call the API from a browser unless --cors-origins says else
LOOPBACK_ORIGINS = r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$"


def _guards(app: FastAPI, state: ServerState) -> None:
    @app.middleware("http")
    async def check_caller(request: Request, call_next):
        """The Host header, then the API key (every route but /health)."""
        refused = check_host(state, request.headers.get("host", "")) or check_key(state, request) \
            or check_content_type(request)
        if refused is not None:
            state.metrics.rejected.labels(str(refused.status)).inc()
            return JSONResponse(refused.body(), status_code=refused.status)
        return await call_next(request)

    # outside the checks above: a browser's preflight (OPTIONS, never with the key) is answered here, and the
    # answers of the checks carry the CORS headers, so a page on an allowed origin can read why it was refused
    origins = list(state.cors_origins or ())
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_origin_regex=None if "*" in origins else
                       LOOPBACK_ORIGINS, allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                       expose_headers=["Retry-After"], max_age=600)


def check_host(state: ServerState, host: str) -> p.APIError | None:
    """A server on a loopback address answers only requests addressed to this machine by name: a web page in the
    user's browser can make a hostile domain resolve to 127.0.0.1 (DNS rebinding) and reach the API, but its
    requests still carry the hostile Host header."""
    if state.allowed_hosts is None:
        return None
    name = host_name(host)
    if name in state.allowed_hosts:
        return None
    return p.APIError(403, f"requests addressed to host {name!r} are not answered here: this server listens on "
                           "this machine only; use http://127.0.0.1 or http://localhost, or start it with "
                           f"--allowed-host {name or 'NAME'}", type="authentication_error", code="host_not_allowed")


def host_name(host: str) -> str:
    """The name part of a Host header: "localhost:8000" -> localhost, "[::1]:8000" -> ::1."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.index("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host


def check_content_type(request: Request) -> p.APIError | None:
    """A browser's POST to the API must declare a JSON body. A page on any site may make the browser send a "simple"
    request (text/plain, form data, or a Blob with no type) without a preflight: without a key, that would start
    completions nobody asked for; a JSON body needs a preflight, which CORS answers (_guards). Browsers mark every
    such request (Origin on any cross-origin POST, Sec-Fetch-Site on all of them since 2023), so only those are held
    to it: other clients (curl -d, scripts) are no page's tool, and their bodies are read as JSON whatever they
    declare."""
    if request.method != "POST" or not request.url.path.startswith("/v1/"):
        return None
    if "origin" not in request.headers and "sec-fetch-site" not in request.headers:
        return None
    given = request.headers.get("content-type", "")
    kind = given.split(";")[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return None
    return p.APIError(415, f"a request from a browser must send its JSON body with 'Content-Type: application/json' "
                           f"(got {given[:100]!r}): add the header", code="unsupported_media_type")


def check_key(state: ServerState, request: Request) -> p.APIError | None:
    """The API key, on every route but /health and the chat page's static files."""
    path = request.url.path
    if not state.api_key or path in ("/health", "/") or path.startswith("/page/"):
        return None
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), state.api_key.encode()):
        return None
    return p.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                      type="authentication_error", code="invalid_api_key")
