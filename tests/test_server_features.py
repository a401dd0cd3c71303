"""What clients of a local server rely on, against a real server process on a tiny random model with the official
openai client and raw HTTP: CORS for browser apps, model names, logprobs, tool calls, llama-server's fields, and
nothing silently ignored. Each peer failure this server once had (a preflight refused, logprobs refused, a
hard-coded model name refused, json_schema and n_predict ignored, no /v1/models/{id}, no timings on the usage
chunk, tools refused) has a test here. The model is random: every valid call or JSON is the grammar's doing."""

import json

import jsonschema
import openai
import pytest

from tests import loopback
from tests.helpers import add_noise, tiny_hf_model, write_gguf_from_hf
from quickdraft.tools.servers import ServerProcess

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# a short template in the hermes family's shape (it names <tool_call>): the real templates' formats are
# tests/test_tools.py's
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
            "Call as <tool_call>.{% endif %}{% for m in messages %}<|{{ m.role }}|>"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}{% endfor %}"
            "{% else %}{{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("feat")
    path = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=5), d / "tiny.gguf", chat_template=TEMPLATE)
    # the target with noise added drafts: its guesses are often right, not always (commits and rollbacks both)
    noisy = add_noise(tiny_hf_model("llama", logit_scale=5))
    draft = write_gguf_from_hf(noisy, d / "draft.gguf", chat_template=TEMPLATE)
    with ServerProcess("-m", str(path), "--draft", str(draft), "--ctx", "256", "--api-key", KEY, "--dtype", "bfloat16",
                       "--alias", "tiny-alias", "--cors-origins", "https://app.example.org",
                       startup_timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def post(server, route, body, headers=None):
    return loopback.post(server.url + route, json=body, headers={**AUTH, **(headers or {})}, timeout=120)


# ---- CORS ---------------------------------------------------------------------------------------------------

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000", "https://app.example.org"])
def test_a_browser_preflight_is_answered_before_the_key_check(server, origin):
    r = loopback.options(server.url + "/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT}, timeout=30)
    assert r.status_code == 200, r.text  # the old server: 401 (the key check) or 405
    assert r.headers["access-control-allow-origin"] == origin
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_an_origin_not_allowed_gets_no_cors_headers(server):
    r = loopback.options(server.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT},
                      timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, {"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers  # the browser will not let that page read it


def test_a_cross_origin_request_still_needs_the_key(server):
    origin = {"Origin": "http://localhost:5173"}
    r = loopback.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=origin, timeout=30)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin["Origin"]  # readable refusal
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin["Origin"]


# ---- model names --------------------------------------------------------------------------------------------

def test_a_hard_coded_model_name_is_answered_by_the_served_model(client):
    served = client.models.list().data[0].id
    r = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hello", max_tokens=3)
    assert r.model == served and r.usage.completion_tokens == 3  # the old server: 404


def test_models_retrieve_knows_the_model_by_its_names(client):
    names = [m.id for m in client.models.list().data]
    assert "tiny-alias" in names
    for name in names:
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_strict_model_names_refuse_others():
    from types import SimpleNamespace

    from quickdraft.server import protocol as p
    from quickdraft.server.requests import check_model

    state = SimpleNamespace(names=frozenset({"m"}), model_id="m", strict_model_name=True)
    req = p.CompletionRequest.model_validate({"prompt": "x", "model": "gpt-4"})
    with pytest.raises(p.APIError) as e:
        check_model(state, req)
    assert e.value.status == 404 and "is not served here" in e.value.message


# ---- fields -------------------------------------------------------------------------------------------------

def test_an_unknown_field_is_a_400_naming_it(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "mirostat": 2})
    assert r.status_code == 400 and "mirostat" in r.json()["error"]["message"]


def test_n_predict_is_max_tokens(server):
    r = post(server, "/v1/completions", {"prompt": "hello", "n_predict": 7})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7  # the old server: to the context's end


def test_a_top_level_json_schema_constrains_the_output(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = post(server, "/v1/chat/completions", {"messages": ASK, "json_schema": schema, "max_tokens": 60})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), schema)  # the old server: unconstrained noise
    assert r.json()["timings"]["constraint"] == "json_schema"


def test_the_final_usage_chunk_carries_timings(client):
    chunks = list(client.chat.completions.create(model="x", messages=ASK, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.usage.completion_tokens == 4
    assert last.model_extra["timings"]["predicted_n"] == 4


# ---- logprobs -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}])
def test_chat_logprobs_are_the_same_with_speculation_on_and_off(client, sampling):
    def scored(speculative):
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "abcabcabcabc"}],
                                           max_tokens=24, logprobs=True, top_logprobs=3, **sampling,
                                           extra_body={"speculative": speculative})
        content = r.choices[0].logprobs.content
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content], r

    off, _ = scored({"draft_max": 0})
    accepted = 0
    assert len(off) == 24 and all(lp <= 0 and len(top) == 3 for _, lp, top in off)
    # (adaptive with draft_min 1: a draft as large as its target costs as much as it saves, and the policy's prices say
    # so before any round; the rounds are what this test needs)
    for speculative in ({"draft_max": 8, "draft_min": 1}, {"draft_max": 4, "adaptive": False}):
        on, r = scored(speculative)
        assert on == off
        assert r.model_extra["timings"]["rounds"] > 0  # it did speculate
        accepted += r.model_extra["timings"]["draft_n_accepted"]
    assert accepted > 0


def test_streamed_logprobs_match_the_whole_answer(client):
    kw = dict(model="x", messages=ASK, max_tokens=12, logprobs=True, temperature=0)
    whole = [t.logprob for t in client.chat.completions.create(**kw).choices[0].logprobs.content]
    streamed = [t.logprob for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == whole and len(whole) == 12


def test_completions_logprobs_in_the_legacy_shape(client):
    r = client.completions.create(model="x", prompt="hello", max_tokens=5, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)


# ---- tools --------------------------------------------------------------------------------------------------

def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_parses_and_fits_its_schema(client, choice):
    for seed in range(3):
        r = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=150, temperature=0.8, seed=seed)
        choice_ = r.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        calls = _calls(choice_.message)
        assert calls and all(len(c.id) == 9 for c in choice_.message.tool_calls)
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
            assert isinstance(choice, str) or name == "get_time"


def test_no_call_with_tool_choice_none(client):
    r = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=20,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" not in r.choices[0].message.content


def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(client):
    kw = dict(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150, temperature=0)
    whole = _calls(client.chat.completions.create(**kw).choices[0].message)
    parts, finish = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            part = parts.setdefault(d.index, {"name": "", "arguments": ""})
            part["name"] += d.function.name or ""
            part["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == whole


def test_one_call_at_most_without_parallel_tool_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


def test_a_tool_result_in_the_history_is_answered(client):
    call = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], tool_choice="required",
                                          max_tokens=150, temperature=0).choices[0].message
    history = ASK + [call, {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temp": 18}'}]
    r = client.chat.completions.create(model="x", messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content is not None


@pytest.mark.parametrize("body, fragment", [
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}]}, "nosuch"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
])
def test_bad_tool_requests_are_400s(server, body, fragment):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_the_server_still_serves(client):
    assert client.completions.create(model="x", prompt="hi", max_tokens=2).usage.completion_tokens == 2


# ---- the chat page: its files without the key, the speculation trace it colours tokens by ---------------------

def test_the_chat_page_is_served_without_the_key_and_fetches_nothing_elsewhere(server):
    r = loopback.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        f = loopback.get(f"{server.url}/page/{name}", timeout=30)
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind) and f"page/{name}" in r.text
        assert "http://" not in f.text and "https://" not in f.text  # no CDN, no font, no script from elsewhere
    for path in ("/page/../app.py", "/page/%2e%2e%2fapp.py", "/page/nothere.js"):
        assert loopback.get(server.url + path, timeout=30).status_code in (401, 404)  # only the page's own files
    assert loopback.get(server.url + "/v1/models", timeout=30).status_code == 401  # the API still needs it


@pytest.mark.parametrize("stream", [False, True])
def test_the_speculation_trace_names_each_tokens_source(server, stream):
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "speculation_trace": True,
            "speculative": {"draft_max": 3, "adaptive": False}, "stream": stream}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        trace = [t for c in chunks for t in c["choices"][0].get("trace", [])]
        timings = chunks[-1]["timings"]
    else:
        text, trace, timings = (r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["trace"],
                                r.json()["timings"])
    # the text is the trace's texts, then what the end released (the bytes of a character it cut off)
    assert len(trace) == 40 and text.startswith("".join(t["text"] for t in trace))
    kept = [t for t in trace if t["source"] != "target"]
    assert len(kept) == timings["draft_n_accepted"] > 0 and {t["source"] for t in kept} == {"draft"}
    assert {t["k"] for t in trace if t["step"] > 0} <= {0, 1, 2, 3} and trace[0] == {**trace[0], "step": 0, "k": 0}
    plain = post(server, "/v1/chat/completions", {**body, "speculative": {"draft_max": 0}, "stream": False}).json()
    assert plain["choices"][0]["message"]["content"] == text
    assert {t["source"] for t in plain["choices"][0]["trace"]} == {"target"}
    assert "trace" not in post(server, "/v1/chat/completions", {**body, "speculation_trace": False,
                                                                "stream": False}).json()["choices"][0]


def test_a_request_asks_for_trees(server):
    """speculative.tree: this request's rounds verify trees of up to 3 candidates (the server's draft offers them),
    its text plain decoding's; the timings count the tree rounds and the candidates kept."""
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": False}
    tree = post(server, "/v1/chat/completions", {**body, "speculative": {"draft_max": 4, "adaptive": False,
                                                                         "tree": 3}}).json()
    plain = post(server, "/v1/chat/completions", {**body, "speculative": {"draft_max": 0}}).json()
    assert tree["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert tree["timings"]["tree_rounds"] > 0 and tree["timings"]["tree_alternatives_kept"] >= 0
    chain = post(server, "/v1/chat/completions", {**body, "speculative": {"draft_max": 4, "adaptive": False}}).json()
    assert chain["timings"]["tree_rounds"] == 0 and chain["timings"]["rounds"] > 0  # the server's default: chains
    assert chain["timings"]["tree_note"] is None  # (none asked for)


def test_a_tree_asked_for_and_not_verified_says_why(server):
    """A request that asks for trees and gets none is told why in its timings (here: log-probabilities are per
    position of a chain); the adaptive policy's own refusals name the figures it measured."""
    body = {"messages": ASK, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "speculative": {"draft_max": 4, "adaptive": False, "tree": 3}}
    t = post(server, "/v1/chat/completions", body).json()["timings"]
    assert t["tree_rounds"] == 0 and "chains only" in t["tree_note"]
    adaptive = post(server, "/v1/chat/completions", {**body, "logprobs": False, "speculative": {"tree": 8}}).json()
    t = adaptive["timings"]
    assert t["tree_rounds"] > 0 or t["tree_note"], t  # verified, or declined saying why


# ---- what the server shows, and to whom --------------------------------------------------------------------------

def test_the_api_pages_are_off_and_the_key_must_come_as_a_bearer_token(server):
    """FastAPI's /docs, /redoc and /openapi.json are not served (serve --api-docs turns them on: their pages load
    scripts from a public CDN); the key is accepted as "Bearer KEY" only, as OpenAI sends it."""
    for route in ("/docs", "/redoc", "/openapi.json"):
        assert loopback.get(server.url + route, headers=AUTH, timeout=30).status_code == 404, route
    bare = loopback.get(server.url + "/v1/models", headers={"Authorization": KEY}, timeout=30)
    assert bare.status_code == 401 and "Bearer" in bare.json()["error"]["message"]
    assert loopback.get(server.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30).status_code \
        == 200


# ---- prefix reuse ---------------------------------------------------------------------------------------------------

def test_a_chats_next_turn_reuses_its_history_and_cache_prompt_false_prefills_it_all(server):
    """As llama-server: the timings say how many prompt tokens a kept slot held (cache_n) and how many were
    prefilled (prompt_n); cache_prompt false prefills the whole prompt; the answer is the same either way."""
    messages = [{"role": "user", "content": "a chat " * 20}]
    first = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0}).json()
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "and then?"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    warm, cold = (post(server, "/v1/chat/completions", {**body, "cache_prompt": c}).json() for c in (True, False))
    assert warm["timings"]["cache_n"] >= first["usage"]["prompt_tokens"]
    assert warm["timings"]["cache_n"] + warm["timings"]["prompt_n"] == warm["usage"]["prompt_tokens"]
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == cold["usage"]["prompt_tokens"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


# ---- several requests at once (--parallel, default 4) ----------------------------------------------------------

def test_requests_at_once_get_what_each_gets_alone(server):
    """Streamed and not, greedy and seeded, with and without speculation, a constraint among them, arriving together
    and stepped in one batch: each answer is the one the request gets alone, and the passes held several requests'
    rows (the batch_rows histogram)."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": f"story {i}: once upon a time", "max_tokens": 24 + 4 * i, "temperature": 0,
               "ignore_eos": True} for i in range(3)]
    bodies += [{"prompt": "seeded", "max_tokens": 20, "temperature": 0.8, "seed": 11, "ignore_eos": True},
               {"prompt": "plain", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "speculative": {"draft_max": 0}},
               {"prompt": "pick", "max_tokens": 12, "temperature": 0, "regex": "(yes|no)( (yes|no))*"}]

    def text(body):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def rows_counted():
        metrics = loopback.get(server.url + "/metrics", headers=AUTH, timeout=30).text
        return {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("quickdraft_batch_rows_")}

    start = rows_counted()["quickdraft_batch_rows_count"]
    alone = [text(b) for b in bodies]
    middle = rows_counted()["quickdraft_batch_rows_count"]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(text, bodies))
    assert together == alone
    passes_alone, passes_together = middle - start, rows_counted()["quickdraft_batch_rows_count"] - middle
    assert passes_together < 0.7 * passes_alone, (passes_alone, passes_together)  # they shared passes
