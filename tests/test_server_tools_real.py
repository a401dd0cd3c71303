"""Tool calls and logprobs on the real default pair (Qwen2.5-Coder 1.5B, drafting with n-gram lookup and the 0.5B),
through the official openai client and through LangChain's OpenAI chat model, as agents and IDE assistants use
an OpenAI-compatible endpoint."""

import json

import jsonschema
import openai
import pytest

from quickdraft.tools.servers import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "qwen2.5-coder-1.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(real_model_path):
    real_model_path(MODEL)
    real_model_path("qwen2.5-coder-0.5b")
    # --draft auto: n-gram + the 0.5B; the format these answers were written against (auto may take int4 on a machine
    # where it decodes faster: its greedy answers are another model's, its tool calls too)
    with ServerProcess("-m", MODEL, "--ctx", "2048", "--weights", "mixed") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          tools=[WEATHER, TIME], max_tokens=120, **kw)


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_calls_the_tool_a_question_needs_and_answers_prose_directly(client):
    r = ask(client, "What's the weather in Paris right now?", **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    ((name, arguments),) = calls_of(r.choices[0].message)
    assert name == "get_weather" and arguments["city"] == "Paris"
    assert r.model_extra["timings"]["rounds"] > 0  # speculated through the tool grammar
    r = ask(client, "Write a haiku about the sea.", **GREEDY)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert len(r.choices[0].message.content) > 10


def test_required_and_named_choices(client):
    r = ask(client, "Hello there!", tool_choice="required", **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls" and calls_of(r.choices[0].message)
    r = ask(client, "What's the weather in Paris?", tool_choice={"type": "function", "function": {"name": "get_time"}},
            **GREEDY)
    ((name, arguments),) = calls_of(r.choices[0].message)
    assert name == "get_time" and "city" in arguments


# An agent's system prompt: without one the 1.5B answers a tool result by calling the tool again.
AGENT = {"role": "system", "content": "You are a helpful assistant. Call tools when you need information; when a "
                                      "tool has returned its result, answer the user's question with it."}


def test_a_tool_result_fed_back_is_answered(client):
    history = [AGENT, {"role": "user", "content": "What's the weather in Paris right now?"}]
    call = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=120,
                                          **GREEDY).choices[0].message
    assert call.tool_calls
    history += [call, {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                       "content": json.dumps({"temperature_celsius": 18, "sky": "cloudy"})}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=80, **GREEDY)
    answer = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and "18" in answer, answer


def test_no_call_under_tool_choice_none(client):
    """Even when the model writes a call as text (this one writes a ```json call with no system prompt)."""
    history = [{"role": "user", "content": "What's the weather in Paris right now?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature_celsius": 18})}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=80, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content


def test_streamed_tool_call_deltas_reassemble(client):
    kw = dict(tool_choice="required", **GREEDY)
    whole = calls_of(ask(client, "Weather in Oslo in fahrenheit?", **kw).choices[0].message)
    parts, finish = {}, None
    for chunk in ask(client, "Weather in Oslo in fahrenheit?", stream=True, **kw):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            part = parts.setdefault(d.index, {"name": "", "arguments": ""})
            part["name"] += d.function.name or ""
            part["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == whole


def test_arguments_fit_their_schema_over_seeded_samples_with_speculation(client):
    accepted = 0
    for seed in range(6):  # each call must parse and fit: a property of every sample, not a distribution's
        r = ask(client, "Weather and local time in a few European capitals, please.", tool_choice="required",
                temperature=0.8, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        for name, arguments in calls_of(r.choices[0].message):
            jsonschema.validate(arguments, SCHEMAS[name])  # an independent validator
        accepted += r.model_extra["timings"]["draft_n_accepted"]
    assert accepted > 0


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 11}])
def test_logprobs_are_identical_with_speculation_off_adaptive_and_fixed(client, sampling):
    def scored(speculative):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
            max_tokens=32, logprobs=True, top_logprobs=4, extra_body={"speculative": speculative}, **sampling)
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                for t in r.choices[0].logprobs.content], r.model_extra["timings"]

    off, _ = scored({"draft_max": 0})
    assert len(off) == 32
    for speculative in ({"draft_max": 16}, {"draft_max": 4, "adaptive": False}):
        on, timings = scored(speculative)
        assert on == off, speculative
        assert timings["draft_n_accepted"] > 0


def test_langchain_tool_round_trip(server):
    """LangChain's ChatOpenAI against this server: the tool call as an AIMessage, the result as a ToolMessage,
    the answer."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({"city": city, "temperature_celsius": 21, "sky": "sunny"})

    llm = ChatOpenAI(base_url=server.base_url, api_key="unused", model="gpt-4o-mini", temperature=0, max_tokens=120,
                     max_retries=0, timeout=300)
    agent = llm.bind_tools([get_weather])
    history = [SystemMessage(AGENT["content"]), HumanMessage("What's the weather in Lisbon?")]
    reply = agent.invoke(history)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert reply.tool_calls[0]["args"]["city"] == "Lisbon"
    history += [reply, ToolMessage(get_weather.invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"])]
    answer = agent.invoke(history)
    assert not answer.tool_calls and "21" in answer.content, answer.content
