"""The server against bad input, a full queue and missing keys: a real server process on a tiny model.

The model is random (its text is noise) but the HTTP stack, the validation, the queue and the engine
thread are the ones users meet.
"""

import json
import re
import string
import threading

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from tests import loopback
from tests.helpers import tiny_hf_model, write_gguf_from_hf
from quickdraft.tools.servers import ServerProcess

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=5), tmp_path_factory.mktemp("srv") / "tiny.gguf",
                              chat_template=TEMPLATE)
    with ServerProcess("-m", str(path), "--draft", "ngram", "--ctx", "64", "--max-queue", "2",
                       "--api-key", KEY, "--dtype", "float32", startup_timeout=120) as s:
        yield s


def post(server, route, body, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body)
    return loopback.post(server.url + route, content=content, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60, **kw)


def test_health_is_open_and_everything_else_needs_the_key(server):
    assert server.get("/health").json()["status"] == "ok"
    for path in ("/v1/models", "/metrics"):
        r = server.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert server.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert server.get(path, headers=AUTH).status_code == 200
    r = loopback.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 401


def test_valid_requests_work(server):
    r = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                              "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("route, body, status, fragment", [
    ("/v1/completions", {"prompt": "x" * 80, "max_tokens": 1}, 400, "fills the context of 64 tokens"),
    ("/v1/completions", {"prompt": [99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "prompt is empty"),
    ("/v1/completions", {"prompt": "x", "speculative": {"draft_max": 4, "draft_min": 5}}, 400, "draft_min"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 1}, 400, "at least 1 item"),
    ("/v1/chat/completions", b'\xc3\x28', 400, "not valid UTF-8"),
    ("/v1/nothing", {}, 404, "Not Found"),
    ("/v1/completions", {"prompt": "x", "regex": "a("}, 400, "unclosed group"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= nothere"}, 400, "invalid grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format":
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}}, 400, "nosuch"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format":
        {"type": "json_schema", "json_schema": "x"}}, 400, "must be an object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format":
        {"type": "xml"}}, 400, "not supported"),
    ("/v1/completions", {"prompt": "x", "regex": "a", "response_format": {"type": "json_object"}}, 400,
     "at most one of"),
])
def test_bad_requests_get_openai_style_errors(server, route, body, status, fragment):
    r = post(server, route, body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_over_http(server, stream):
    """A random model, so every valid output is the mask's doing; the server ends it when it is complete."""
    def text_of(route, body):
        r = post(server, route, {**body, "stream": stream, "max_tokens": 32})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        pieces = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                  for c in chunks if c["choices"]]
        return "".join(pieces), next(c["choices"][0]["finish_reason"] for c in chunks
                                     if c["choices"] and c["choices"][0]["finish_reason"])
    chat = {"messages": [{"role": "user", "content": "j"}]}
    cases = {  # route, constraint fields, check of a complete output
        "json_schema": ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "pick", "schema": SCHEMA, "strict": True}}},
            lambda t: (v := json.loads(t))["color"] in ("red", "green") and 0 <= v["n"] <= 9),
        "json_object": ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}},
                        lambda t: isinstance(json.loads(t), dict)),
        "regex": ("/v1/completions", {"prompt": "mail: ", "regex": "[a-c]{1,4}@x\\.org"},
                  lambda t: re.fullmatch("[a-c]{1,4}@x\\.org", t)),
        "grammar": ("/v1/completions", {"prompt": "list: ", "grammar": 'root ::= "[" [0-9] ("," [0-9])? "]"'},
                    lambda t: re.fullmatch(r"\[[0-9](,[0-9])?\]", t)),
    }
    complete = dict.fromkeys(cases, 0)
    for name, (route, body, check) in cases.items():
        for seed in range(4):
            text, finish = text_of(route, {**body, "seed": seed})
            if finish == "stop":  # an output reported complete is always valid
                assert check(text), (name, text)
                complete[name] += 1
            else:  # one that ran out of tokens (the random model likes blanks) says so
                assert finish == "length", (name, finish)
    assert all(complete[name] > 0 for name in ("json_schema", "regex", "grammar")), complete


def test_a_full_queue_answers_503_with_retry_after_and_loses_no_accepted_request(server):
    results = []

    def call():
        results.append(post(server, "/v1/completions", {"prompt": "count", "max_tokens": 55, "ignore_eos": True, "temperature": 0}))

    threads = [threading.Thread(target=call) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    busy = [r for r in results if r.status_code == 503]
    assert busy and all(int(r.headers["Retry-After"]) >= 1 for r in busy), codes
    assert codes.count(200) >= 3  # one running and two waiting at any time; more once slots free up
    done = [r.json() for r in results if r.status_code == 200]
    assert all(d["usage"]["completion_tokens"] == 55 for d in done)
    assert len({d["choices"][0]["text"] for d in done}) == 1  # greedy: every accepted request, same answer


# ---- fuzzing the request bodies -------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
small_ints = st.integers(-3, 12)
field_values = {
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=5) | json_values,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]) | json_values,
         "content": st.text(max_size=20) | json_values}), max_size=3) | json_values,
    "max_tokens": small_ints | json_values,
    "max_completion_tokens": small_ints,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "top_k": small_ints,
    "min_p": st.floats(-0.5, 1.5, allow_nan=False),
    "presence_penalty": st.floats(-3, 3, allow_nan=False),
    "frequency_penalty": st.floats(-3, 3, allow_nan=False),
    "repetition_penalty": st.floats(-1, 3, allow_nan=False),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=20) | json_values,
    "seed": st.integers(-2**70, 2**70) | json_values,
    "n": small_ints,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "speculative": st.fixed_dictionaries({}, optional={"draft_max": small_ints, "draft_min": small_ints,
                                                       "adaptive": st.booleans()}) | json_values,
    "model": st.sampled_from(["tiny", "other"]) | json_values,
    "logprobs": st.booleans() | json_values,
    "echo": st.booleans(),
    "response_format": json_values,
}
bodies = st.fixed_dictionaries({}, optional=field_values).flatmap(
    lambda d: st.dictionaries(st.text(string.ascii_letters, max_size=6), json_values, max_size=2).map(
        lambda extra: {**extra, **d}))


# Bodies close to valid ones (so that generation, streaming and stop strings are exercised too), with at
# most one field replaced by anything at all.
plausible = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 0.9), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**32), "stream": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=3), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "speculative": st.fixed_dictionaries({}, optional={"draft_max": st.integers(0, 8), "adaptive": st.booleans()}),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.text(max_size=12)})
near_valid = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    st.fixed_dictionaries({"max_tokens": st.integers(0, 8)}, optional=plausible),
    st.text(min_size=1, max_size=20), st.lists(message, min_size=1, max_size=3),
    st.none() | st.tuples(st.sampled_from(sorted(field_values)), json_values),
).map(lambda t: (t[0], {**t[1], **({"prompt": t[2]} if t[0] == "/v1/completions" else {"messages": t[3]}),
                        **(dict([t[4]]) if t[4] else {})}))
anything = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                     bodies | json_values | st.binary(max_size=40))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=near_valid | anything)
def test_fuzzed_bodies_never_get_a_5xx(server, request):
    route, body = request
    r = post(server, route, json.dumps(body).encode() if not isinstance(body, bytes) else body)
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"]
    elif "text/event-stream" in r.headers["content-type"]:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_server_still_serves_after_the_fuzzing(server):
    assert server.get("/health").json() == {"status": "ok", "waiting": 0, "running": False}
    assert post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2}).status_code == 200
    assert server.proc.poll() is None
