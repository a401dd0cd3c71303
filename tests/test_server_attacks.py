"""One request must never kill, stall or poison the server: a real server process on a tiny model, attacked as an
adversarial client would. After every attack it answers /health and a normal request, correctly, and its memory is
back near where it started."""

import json
import socket
import threading
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests import loopback
from tests.helpers import gbnf_chain, lark_chain, ref_chain, tiny_hf_model, write_gguf_from_hf
from quickdraft.tools.servers import ServerProcess

KEY = "attack-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REQUEST_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("attacks")
    path = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=5), d / "tiny.gguf", chat_template=TEMPLATE, eos=True)
    (d / "key").write_text(KEY + "\n")
    with ServerProcess("-m", str(path), "--draft", "ngram", "--ctx", "1024", "--max-queue", "2", "--parallel", "1",
                       "--api-key-file",
                       str(d / "key"), "--dtype", "float32", "--request-timeout", str(REQUEST_TIMEOUT_S),
                       startup_timeout=120) as s:
        s.rss_start = psutil.Process(s.pid).memory_info().rss
        yield s


def post(server, body, route="/v1/completions", **kw):
    content = body if isinstance(body, bytes) else json.dumps(body)
    return loopback.post(server.url + route, content=content, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=120, **kw)


def still_serving(server):
    assert server.proc.poll() is None, server.stderr()
    assert server.get("/health").json()["status"] == "ok"
    r = post(server, {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    rss = psutil.Process(server.pid).memory_info().rss
    assert rss < server.rss_start + (300 << 20), (rss >> 20, server.rss_start >> 20)


def test_the_key_is_never_printed(server):
    assert all(KEY not in line for line in server.printed)
    assert '"Authorization: Bearer $QUICKDRAFT_API_KEY"' in server.printed[-1]  # the curl line


@pytest.mark.parametrize("name, fields, fragment", [
    ("3000-rule Lark chain", {"grammar": lark_chain(3000)}, "rules: at most 1000"),
    ("6000-rule GBNF chain", {"grammar": gbnf_chain(6000)}, "bytes: at most"),
    ("20k-rule GBNF", {"grammar": gbnf_chain(20000)}, "bytes: at most"),
    ("2000 $ref chain", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                   "schema": ref_chain(2000)}}}, "$ref"),
    ("regex that fails at its first token", {"regex": "a{1000}{1000}"}, "lexer error"),
])
def test_constraints_that_crash_or_stall_a_compiler_are_a_400(server, name, fields, fragment):
    r = post(server, {"prompt": "x", "max_tokens": 4, **fields})
    assert r.status_code == 400, (name, r.text)
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] in ("grammar", "regex", "response_format")
    assert "<state" not in error["message"] and "grammar>" not in error["message"]  # no internal state
    still_serving(server)


@pytest.mark.parametrize("name, body, status, fragment, param", [
    ("1M floats as a prompt", json.dumps({"prompt": [0.5] * 1_000_000}).encode(), 400, "at most 131072", "prompt"),
    ("100k floats as a prompt", json.dumps({"prompt": [0.5] * 100_000}).encode(), 400, "list of token ids", "prompt"),
    ("a 7.8 MB prompt", json.dumps({"prompt": "a " * 3_900_000}).encode(), 400, "more than the context", "prompt"),
    ("250k messages", json.dumps({"messages": [{"role": "user", "content": "x"}] * 250_000}, separators=(",", ":")).encode(), 400,
     "at most 4096", "messages"),
    ("a lone surrogate in a prompt", b'{"prompt": "ab\\ud800c"}', 400, "unpaired UTF-16 surrogate", "prompt"),
    ("a lone surrogate in a message", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "unpaired UTF-16 surrogate", "messages.0.content"),
    ("100000 [", b"[" * 100_000, 400, "too deeply", None),
    ("16 stops of 400k characters", json.dumps({"prompt": "x", "stop": ["-" * 400_000 + "X"] * 16}).encode(), 400,
     "at most 512 characters", "stop"),
])
def test_hostile_bodies_are_a_4xx_naming_the_field(server, name, body, status, fragment, param):
    route = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    r = post(server, body, route)
    assert r.status_code == status, (name, r.text[:300])
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, (name, error)
    still_serving(server)


def test_a_tiny_top_p_samples_the_top_token(server):
    r = post(server, {"prompt": "hi", "max_tokens": 6, "temperature": 1, "top_p": 1e-300, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    greedy = post(server, {"prompt": "hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_long_near_matching_stop_strings_cost_nothing_extra(server):
    r = post(server, {"prompt": "x", "regex": "-{300}", "stop": ["-" * 511 + "X"] * 16, "max_tokens": 600})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "-" * 300  # held back while it could match, released at the end
    still_serving(server)


def test_a_queued_request_whose_client_left_frees_its_place_at_once(server):
    """max-queue 2: one long request runs, two wait and then go away; two new clients are admitted at once, not
    503 until the running request ends."""
    done = {}
    long = threading.Thread(target=lambda: done.setdefault("long", post(server, {
        "prompt": "count", "max_tokens": 1000, "temperature": 0, "ignore_eos": True})))
    long.start()
    while not server.get("/health").json()["running"]:
        time.sleep(0.01)
    leavers = []
    for _ in range(2):  # raw sockets, so that leaving is closing the connection
        s = socket.create_connection((server.url.split("//")[1].split(":")[0], int(server.url.rsplit(":", 1)[1])))
        body = json.dumps({"prompt": "wait", "max_tokens": 8, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        leavers.append(s)
    deadline = time.monotonic() + 30
    while server.get("/health").json()["waiting"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.get("/health").json()["waiting"] == 2
    for s in leavers:
        s.close()
    while server.get("/health").json()["waiting"] > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.get("/health").json()["running"], "the long request should still be running"
    results = []
    newcomers = [threading.Thread(target=lambda: results.append(post(server, {"prompt": "new", "max_tokens": 2})))
                 for _ in range(2)]
    for t in newcomers:
        t.start()
    for t in newcomers:
        t.join()
    long.join()
    assert [r.status_code for r in results] == [200, 200] and done["long"].status_code == 200
    still_serving(server)


def test_requests_addressed_to_another_host_are_refused(server):
    """DNS rebinding: a page on a hostile domain resolving to 127.0.0.1 sends that domain as its Host."""
    r = loopback.get(server.url + "/health", headers={"Host": "evil.example:8000"}, timeout=10)
    assert r.status_code == 403 and "--allowed-host" in r.json()["error"]["message"]
    assert loopback.post(server.url + "/v1/completions", headers={"Host": "evil.example", **AUTH},
                      json={"prompt": "x", "max_tokens": 1}, timeout=10).status_code == 403
    port = server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert loopback.get(server.url + "/health", headers={"Host": host}, timeout=10).status_code == 200


def test_a_client_that_leaves_mid_body_is_not_an_error_of_ours(server):
    host, port = server.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"prompt": "')
    time.sleep(0.2)
    s.close()
    time.sleep(0.5)
    log = server.stderr()
    assert "unexpected error" not in log and "Traceback" not in log, log
    still_serving(server)


def test_connections_that_never_finish_a_request_head_are_closed(server):
    """slowloris: connections that send a request head a byte at a time are dropped after --request-timeout."""
    host, port = server.url.split("//")[1].split(":")
    sockets = []
    for _ in range(200):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.settimeout(REQUEST_TIMEOUT_S + 10)
        sockets.append(s)
    still_serving(server)  # served meanwhile
    for i in range(3):  # a byte now and then: the trickle does not keep a connection alive
        time.sleep(REQUEST_TIMEOUT_S / 3)
        for s in sockets:
            try:
                s.sendall(b"X")
            except OSError:
                pass
    closed = 0
    for s in sockets:
        try:
            closed += s.recv(100) == b""
        except OSError:
            closed += 1
        s.close()
    assert closed == len(sockets)
    still_serving(server)


# ---- fuzzing constraints ----------------------------------------------------------------------------------------

_regex = st.lists(st.sampled_from(["a", "b|c", "(", ")", "[a-z]", "[^x]", "{2}", "{1,3}", "*", "+", "?", ".", "\\d",
                                   "\\", "{1000}", "(a|b)*", "^", "$"]), max_size=10).map("".join)
_gbnf_rule = st.sampled_from(['"a"', '[0-9]', 'x', '"b" x', '( "c" | x )*', '"d"?', 'root', '[^"]', '"\\n"'])
_gbnf = st.lists(_gbnf_rule, min_size=1, max_size=6).map(lambda rs: "root ::= " + rs[0] + "\nx ::= " + " ".join(rs[1:]) + ' "e"\n')
_schema = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": 0}, {"enum": ["a", "b"]}, {"type": "boolean"},
                     {"type": "nosuch"}, {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "a{2,"}]),
    lambda inner: st.one_of(st.builds(lambda i: {"type": "array", "items": i}, inner),
                            st.builds(lambda d: {"type": "object", "properties": d, "required": list(d)[:1]},
                                      st.dictionaries(st.sampled_from(["p", "q", "r"]), inner, max_size=3)),
                            st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)),
    max_leaves=8)
_adversarial = st.sampled_from([
    {"grammar": lark_chain(990)}, {"grammar": gbnf_chain(900)}, {"regex": "(" * 60 + "a" + ")" * 60},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ref_chain(450)}}},
    {"regex": "(a{100}){100}"}, {"regex": "[\\u0000-\\uffff]{500}"}, {"grammar": "start: " + "|".join(f'"{i}"' for i in range(2000))},
])
constraints = st.one_of(
    _regex.map(lambda r: {"regex": r}), _gbnf.map(lambda g: {"grammar": g}),
    _schema.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": s}}}),
    _adversarial)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(fields=constraints)
def test_fuzzed_constraints_never_kill_or_wedge_the_server(server, fields):
    r = post(server, {"prompt": "go: ", "max_tokens": 8, **fields})
    assert r.status_code in (200, 400), r.text[:500]
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["message"] and error["param"] in ("grammar", "regex", "response_format") and "\n" not in error["message"]
    assert server.proc.poll() is None, server.stderr()


def test_the_server_still_serves_after_the_attacks(server):
    still_serving(server)
    assert server.get("/health").json() == {"status": "ok", "waiting": 0, "running": False}
