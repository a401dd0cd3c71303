"""Clients that misbehave, against a real server process on a tiny model: requests abandoned in the
queue, bodies whose validation multiplies, slow connections, grammar bombs, tool schemas as agent frameworks write
them, unbounded fields, odd keys and content types, too many tools, special-token text in messages, huge model
names. Each test prints what it measured; none asserts a speed."""

import json
import re
import socket
import threading
import time

import psutil
import pytest

from tests import loopback
from tests.helpers import gbnf_chain, tiny_hf_model, write_gguf_from_hf
from quickdraft.tools.servers import ServerProcess
from tests.server_process import HealthWatch, event_loop_tasks, metric, raw_socket, request_bytes

KEY = "misbehaving-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# turns end with the end-of-text control token, and the tools are rendered, as real templates do
TEMPLATE = ("{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
HEAD_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("misbehaving")
    path = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=5), d / "tiny.gguf", chat_template=TEMPLATE, eos=True)
    with ServerProcess("-m", str(path), "--draft", "ngram", "--ctx", "2048", "--max-queue", "3", "--parallel", "1",
                       "--api-key", KEY,
                       "--dtype", "float32", "--request-timeout", str(HEAD_TIMEOUT_S), startup_timeout=120) as s:
        s.rss_start = rss(s)
        yield s


def rss(server) -> int:
    return psutil.Process(server.pid).memory_info().rss


def post(server, body, route="/v1/completions", headers=None, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body)
    return loopback.post(server.url + route, content=content,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})}, timeout=300, **kw)


def health(server) -> dict:
    return server.get("/health").json()


def tasks(server) -> int:
    return event_loop_tasks(server.url, AUTH)


def still_serving(server):
    assert server.proc.poll() is None, server.stderr()
    assert health(server)["status"] == "ok"
    r = post(server, {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def wait_for(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def settled_tasks(server, baseline: int, timeout_s=10.0) -> int:
    """The task count once it is back at the baseline (or whatever it is after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while (n := tasks(server)) > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


# ---- 1. abandoned queued requests -----------------------------------------------------------------------------

def test_abandoned_queued_requests_leave_no_handler_behind(server):
    """Non-streamed requests whose clients leave while they wait in the queue: the worker skips them, and their
    handlers must end too (they waited for an end event forever: 511 of them made every request 503)."""
    baseline = tasks(server)
    done = {}
    long = threading.Thread(target=lambda: done.setdefault("long", post(server, {
        "prompt": "count", "max_tokens": 400, "temperature": 0, "ignore_eos": True})))
    long.start()
    wait_for(lambda: health(server)["running"])
    leavers = [raw_socket(server.url, request_bytes({"prompt": f"wait {i}", "max_tokens": 8}, KEY)) for i in range(3)]
    wait_for(lambda: health(server)["waiting"] == 3)
    for s in leavers:
        s.close()
    long.join()
    wait_for(lambda: health(server) == {"status": "ok", "waiting": 0, "running": False})
    left = settled_tasks(server, baseline)
    print(f"\nabandoned queued requests: 3; event-loop tasks before {baseline}, after {left}")
    assert done["long"].status_code == 200
    assert left <= baseline, f"{left - baseline} tasks left behind by 3 abandoned requests"
    still_serving(server)


# ---- 2. validation that multiplies ----------------------------------------------------------------------------

MULTIPLYING = {  # each list within its cap, the items they multiply to far beyond the bound on values
    "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{}] * 1365}] * 512}),  # 700k
    "prompt": ("/v1/completions", {"prompt": [[{}] * 131072] * 21}),  # 2.75M, in 8 MiB
}


@pytest.mark.parametrize("field", MULTIPLYING)
def test_nested_lists_within_their_caps_cannot_multiply_the_work(server, field):
    """512 messages x 1365 empty content parts (2.1 MB), and a prompt of 21 lists of 131072 empty objects (8 MiB):
    each list within its cap, millions of items in all."""
    route, payload = MULTIPLYING[field]
    body = json.dumps(payload, separators=(",", ":")).encode()
    before = rss(server)
    with HealthWatch(server.url) as watch:
        start = time.perf_counter()
        r = post(server, body, route)
        took = time.perf_counter() - start
    after = rss(server)
    print(f"\n{len(body) / 1e6:.1f} MB body multiplying under {field}: HTTP {r.status_code} in {took:.2f} s, /health "
          f"worst {watch.worst:.2f} s, RSS {before >> 20} -> {after >> 20} MiB; {r.json()['error']['message'][:120]}")
    assert r.status_code == 400
    error = r.json()["error"]
    assert "values" in error["message"] and error["param"] == field, error
    assert after < before + (200 << 20)
    still_serving(server)


# ---- 3. slow connections --------------------------------------------------------------------------------------

SLOW = {  # what a slow client sends on each connection, and how many connections it opens
    "heads": (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", 600),  # no key needed
    "bodies": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{".encode(), 767),
}


@pytest.mark.parametrize("part", SLOW)
def test_slow_connections_do_not_lock_out_real_clients(server, part):
    """Connections that send a request head slowly (600, no key needed), or a complete head and then their body
    slowly (767: one fewer than uvicorn's limit of 768 open connections, which a request head beyond gets a 503 and
    a close): /health and a real request are still answered while they are open."""
    host, port = server.url.split("//")[1].split(":")
    sent, count = SLOW[part]
    slow = []
    try:
        for i in range(count):
            s = socket.create_connection((host, int(port)))
            s.sendall(sent)
            slow.append(s)
            if i % 100 == 99:  # a round trip, so that the server reads these heads before more connections come
                server.get("/health")
        time.sleep(0.5)
        start = time.perf_counter()
        h = server.get("/health")
        r = post(server, {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        print(f"\n{count} connections sending their {part} slowly: /health HTTP {h.status_code}, a completion HTTP "
              f"{r.status_code} ({time.perf_counter() - start:.2f} s for both)")
        assert h.status_code == 200, h.text
        assert r.status_code == 200, r.text
    finally:
        for s in slow:
            s.close()
    still_serving(server)


# ---- 4. compile lanes -----------------------------------------------------------------------------------------

def test_gbnf_rules_separated_by_carriage_returns_count_as_rules(server):
    chain = gbnf_chain(3000).replace("\n", "\r")  # 64 KB at most: within the byte bound
    start = time.perf_counter()
    r = post(server, {"prompt": "x", "max_tokens": 4, "grammar": chain[:60_000].rsplit("\r", 1)[0]})
    print(f"\n\\r-separated GBNF chain: HTTP {r.status_code} in {time.perf_counter() - start:.2f} s: "
          f"{r.json().get('error', {}).get('message', '')[:100]}")
    assert r.status_code == 400 and "rules: at most 1000" in r.json()["error"]["message"], r.text


def test_compiles_do_not_take_plain_requests_places(server):
    """--max-queue 3 and six constraints compiling: a plain request is admitted, and /health shows no request
    waiting (compiles wait for the compiler, not in the engine's queue). The compiler's children are stopped
    meanwhile, so that the compiles last however fast the machine is."""
    def compiler_children():
        return [c for c in psutil.Process(server.pid).children() if "quickdraft.server.sandbox" in c.cmdline()]

    wait_for(lambda: len(compiler_children()) >= 2)  # the shared lanes' children, started with the server
    children = compiler_children()
    results = {}

    def constrained(i):  # each its own constraint: nothing kept from before
        results[i] = post(server, {"prompt": "x", "max_tokens": 2, "regex": f"[ab]{{{i + 2}}}c"})

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(6)]
    for c in children:
        c.suspend()
    try:
        for t in threads:
            t.start()
        wait_for(lambda: metric(server.url, AUTH, "quickdraft_grammar_compiles") == 6)
        waiting = health(server)["waiting"]
        plain = post(server, {"prompt": "hello", "max_tokens": 2})
    finally:
        for c in children:
            c.resume()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results.values())
    print(f"\nsix compiles held (the compiler's {len(children)} children stopped): /health waiting {waiting}, a plain "
          f"request HTTP {plain.status_code}; the six: {codes}")
    assert waiting == 0 and plain.status_code == 200, plain.text
    # compiled, they all want one of the 3 places at once: some get the queue's 503, none the compiler's
    assert all(r.status_code == 200 or "queue slot" in r.text for r in results.values()), [
        r.text[:200] for r in results.values()]
    still_serving(server)


# ---- 5. tool schemas as Pydantic writes them ------------------------------------------------------------------

# Pydantic's $defs, and "#" (the parameters' own root); each bounded, so that any call the grammar allows ends well
# within max_tokens
PYDANTIC_TOOL = {"type": "function", "function": {"name": "plan", "parameters": {
    "$defs": {"Step": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
                       "additionalProperties": False}},
    "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "maxItems": 2}},
    "required": ["steps"], "additionalProperties": False}}}
TREE_TOOL = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0}},
    "required": ["kids"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool", [PYDANTIC_TOOL, TREE_TOOL], ids=["defs", "root"])
def test_tool_schemas_with_refs_resolve_within_their_parameters(server, tool):
    """The call is forced (tool_choice required, one call): it must end and fit the tool's own schema (what "#"
    means is checked against the real vocabulary in test_tools)."""
    import jsonschema

    r = post(server, {"messages": [{"role": "user", "content": "go"}], "tools": [tool], "tool_choice": "required",
                      "parallel_tool_calls": False, "max_tokens": 800, "seed": 1}, "/v1/chat/completions")
    print(f"\ntool with $ref ({tool['function']['name']}): HTTP {r.status_code} {r.text[:160]}")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == tool["function"]["name"]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


# ---- 6. fields outside the character bound -------------------------------------------------------------------

@pytest.mark.parametrize("field", ["tools", "chat_template_kwargs"])
def test_tool_descriptions_and_template_variables_count_toward_the_bound(server, field):
    big = "lorem ipsum " * 600_000  # 7.2 MB
    extra = {"tools": [{"type": "function", "function": {"name": "f", "description": big}}]} if field == "tools" \
        else {"chat_template_kwargs": {"note": big}}
    before = rss(server)
    with HealthWatch(server.url) as watch:
        start = time.perf_counter()
        r = post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra},
                 "/v1/chat/completions")
        took = time.perf_counter() - start
    after = rss(server)
    print(f"\n7.2 MB in {field}: HTTP {r.status_code} in {took:.2f} s, /health worst {watch.worst:.2f} s, RSS "
          f"{before >> 20} -> {after >> 20} MiB; {r.text[:150]}")
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "characters" in r.json()["error"]["message"]
    still_serving(server)


def test_the_bound_on_all_a_template_renders_names_the_largest_part(server):
    """Messages and chat_template_kwargs each within the bound, over it together: the error names the larger."""
    def chat(content, kwargs=None):
        return post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 1,
                             **({"chat_template_kwargs": kwargs} if kwargs else {})}, "/v1/chat/completions")

    limit = int(re.search(r"at most (\d+)", chat("x" * 5_000_000).json()["error"]["message"])[1])
    r = chat("x" * (limit * 2 // 5), {"note": "y" * (limit * 3 // 5)})
    print(f"\n{limit * 2 // 5} characters of messages and {limit * 3 // 5} of kwargs: HTTP {r.status_code} {r.text[:200]}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


# ---- 7. the small ones ----------------------------------------------------------------------------------------

def test_a_lone_surrogate_as_a_key_is_a_400(server):
    for body in (b'{"prompt": "x", "\\ud800": 1}', b'{"prompt": "x", "stream_options": {"\\udfff": true}}'):
        r = post(server, body)
        print(f"\n{body!r}: HTTP {r.status_code} {r.text[:150]}")
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    assert "Traceback" not in server.stderr()


BROWSER = {"cross-site page": {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
           "sandboxed frame": {"Origin": "null"}, "older browser": {"Sec-Fetch-Site": "cross-site"}}


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
@pytest.mark.parametrize("browser", BROWSER)
def test_a_browser_body_that_is_not_declared_json_is_refused(server, content_type, browser):
    """A page on another site can make the browser POST text/plain (or form data, or a Blob with no type) without a
    preflight: such a request must not start a completion. Browsers mark it (Origin, Sec-Fetch-Site)."""
    headers = {**AUTH, **BROWSER[browser], **({"Content-Type": content_type} if content_type else {})}
    r = loopback.post(server.url + "/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
                   headers=headers, timeout=30)
    print(f"\n{browser}, Content-Type {content_type}: HTTP {r.status_code} {r.text[:150]}")
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], r.text
    ok = post(server, {"prompt": "x", "max_tokens": 1},
              headers={**BROWSER[browser], "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None])
def test_clients_that_are_not_browsers_need_no_content_type(server, content_type):
    """curl -d (form-urlencoded) and fetch or scripts without headers: no page's tool, answered as JSON."""
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = loopback.post(server.url + "/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
                   headers=headers, timeout=30)
    assert r.status_code == 200, r.text


def test_more_tools_than_the_bound_are_refused(server):
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    r = post(server, {"messages": [{"role": "user", "content": "hi"}], "tools": many, "max_tokens": 1},
             "/v1/chat/completions")
    print(f"\n129 tools: HTTP {r.status_code} {r.text[:150]}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "128" in r.text, r.text


def test_special_token_text_in_a_message_stays_text(server):
    """'<|endoftext|>' typed in a message is 13 characters of text, not the control token (the template's own
    end-of-turn marks stay control tokens)."""
    def prompt_tokens(content):
        r = post(server, {"messages": [{"role": "user", "content": content}], "max_tokens": 1},
                 "/v1/chat/completions")
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain, injected = prompt_tokens("a"), prompt_tokens("a<|endoftext|>")
    print(f"\n'a': {plain} prompt tokens; 'a<|endoftext|>': {injected}")
    assert injected - plain == len("<|endoftext|>")  # one byte-level token per character in this vocabulary


def test_other_model_names_are_not_kept_in_full(server):
    before = rss(server)
    answers = [post(server, {"model": f"{i}" + "m" * 4_000_000, "prompt": "x", "max_tokens": 1})
               for i in range(16)]  # each a distinct 4 MB name: answered, they were kept (64 of 8 MB: 512 MB)
    after = rss(server)
    print(f"\n16 model names of 4 MB: HTTP {sorted({r.status_code for r in answers})}, RSS {before >> 20} -> "
          f"{after >> 20} MiB (printed, not asserted: parsing 4 MB bodies on threads leaves allocator arenas)")
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "model" for r in answers), answers[0].text
    assert "256" in answers[0].json()["error"]["message"]


def test_the_server_still_serves_after_the_misbehaviour(server):
    still_serving(server)
    print(f"\nRSS at start {server.rss_start >> 20} MiB, now {rss(server) >> 20} MiB")
