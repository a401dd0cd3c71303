"""The server on a real model, driven by the official openai client: what editors and scripts will meet.

smollm2-135m is the target; its int4 copy drafts (int4 changes its distributions, so drafts are both
accepted and rejected), with suffix decoding in front.
"""

import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import loopback
from quickdraft.tools.servers import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
GREEDY = {"temperature": 0}
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "用一句话介绍长城。",
]


@pytest.fixture(scope="module")
def server(real_model_path):
    real_model_path(MODEL)
    with ServerProcess("-m", MODEL, "--draft", f"suffix,{MODEL}", "--ctx", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def stream_chat(client, content, **kw):
    chunks = list(chat(client, content, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_the_server_says_where_it_listens_and_how_to_call_it(server):
    assert server.printed[0].startswith(f"quickdraft: serving {MODEL} (draft: suffix,{MODEL}")
    assert server.base_url.startswith("http://127.0.0.1:")
    assert server.printed[1] == f"chat page: {server.url}/\n"
    # what the kept conversations may hold: on the CPU a byte budget (llama-server's 8 GiB default, at most a quarter of
    # the machine's memory), more conversations than run at once
    assert server.printed[2].startswith("cache: ") and " GiB for kept sequences: " in server.printed[2]
    # the kernel path, the compute dtype and whether output is bit-exact there (runtime/plan.cpu_path)
    assert server.printed[3].startswith("kernels: ") and "compute" in server.printed[3] and "exact" in server.printed[3]
    assert server.printed[4].startswith(f"try: curl {server.url}/v1/chat/completions")


def test_models_lists_the_target(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["context_length"] == 1024


def test_chat_non_streaming_carries_usage_and_timings(client):
    r = chat(client, PROMPTS[0], max_tokens=40, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 40 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["prompt_n"] == r.usage.prompt_tokens and t["predicted_n"] == r.usage.completion_tokens
    for field in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second", "draft_n",
                  "draft_n_accepted", "mean_accepted_length", "accept_per_position", "k_history", "acceptance_rate"):
        assert field in t
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]


def test_chat_streaming_gives_the_same_text_then_finish_and_usage(client):
    whole = chat(client, PROMPTS[1], max_tokens=32, **GREEDY)
    text, chunks = stream_chat(client, PROMPTS[1], max_tokens=32, stream_options={"include_usage": True}, **GREEDY)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "timings" in final[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_streaming_and_not(client):
    kw = dict(model=MODEL, prompt="def add(a, b):\n", max_tokens=16, **GREEDY)
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == whole.choices[0].text and whole.object == "text_completion"


def test_max_tokens_is_exact(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, extra_body={"ignore_eos": True},
                                  **GREEDY)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_before_them(client, stream):
    full = chat(client, PROMPTS[0], max_tokens=60, **GREEDY).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    expected = full[:full.index(stop)]
    if stream:
        text, chunks = stream_chat(client, PROMPTS[0], max_tokens=60, stop=[stop, "never appears"], **GREEDY)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        r = chat(client, PROMPTS[0], max_tokens=60, stop=stop, **GREEDY)
        text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
    assert text == expected and finish == ["stop"]


def test_seed_makes_sampling_reproducible_with_or_without_speculation(client):
    kw = dict(temperature=1.0, max_tokens=32)
    poem = "Write a short poem about autumn."
    first = chat(client, poem, seed=1234, **kw).choices[0].message.content
    assert chat(client, poem, seed=1234, **kw).choices[0].message.content == first
    plain = chat(client, poem, seed=1234, extra_body={"speculative": {"draft_max": 0}}, **kw)
    assert plain.choices[0].message.content == first  # and the same without speculation
    others = {chat(client, poem, seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert others != {first}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculation_on_and_off_give_identical_greedy_text(client, prompt):
    texts, timings = {}, {}
    for name, spec in [("off", {"draft_max": 0}), ("adaptive", None), ("fixed-4", {"draft_max": 4, "adaptive": False})]:
        r = chat(client, prompt, max_tokens=48, extra_body={"speculative": spec} if spec else None, **GREEDY)
        texts[name], timings[name] = r.choices[0].message.content, r.model_extra["timings"]
    assert texts["adaptive"] == texts["off"] and texts["fixed-4"] == texts["off"]
    assert timings["off"]["draft_n"] == 0 and timings["off"]["drafter"] == "none"
    assert timings["fixed-4"]["draft_n"] > 0 and set(timings["fixed-4"]["k_history"]) - {0} <= {1, 2, 3, 4}


def test_bad_requests_are_4xx_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "hi", max_tokens=-1)
    long = client.completions.create(model=MODEL, prompt="count with me: " + "one two three " * 320,
                                     max_tokens=10**6, extra_body={"ignore_eos": True})  # beyond the context
    assert long.choices[0].finish_reason == "length"  # capped to the room left, as OpenAI and llama-server do
    assert long.usage.prompt_tokens > 900 and long.usage.prompt_tokens + long.usage.completion_tokens == 1024
    # A name the server does not know is answered by the served model (clients hard-code names), and says so.
    other = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2)
    assert other.model == MODEL and other.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="at least 1 item"):
        client.chat.completions.create(model=MODEL, messages=[])
    assert chat(client, "hi", max_tokens=2).usage.completion_tokens <= 2
    assert server.get("/health").json()["status"] == "ok"


def test_a_client_that_disconnects_frees_the_engine_at_once(server, client):
    body = {"model": MODEL, "prompt": "Count from one to a thousand:", "max_tokens": 900, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with loopback.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break  # leave after a few tokens; 900 tokens would take half a minute or more
    deadline = time.time() + 10
    while server.get("/health").json()["running"] and time.time() < deadline:
        time.sleep(0.1)
    assert not server.get("/health").json()["running"]
    assert chat(client, "hi", max_tokens=2).choices[0].finish_reason in ("stop", "length")
    assert metric(server, "quickdraft_request_success_total", finish_reason="cancelled") >= 1


def metric(server, name, **labels) -> float:
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_metrics_count_the_prefix_cache_and_slots_show_what_they_hold(client, server):
    """A prompt sent twice: the second takes all but its last token from its slot, counted as vLLM counts its prefix
    cache (tokens looked up, tokens found); GET /slots lists the slots as llama-server's does (counts, no text)."""
    before = {n: metric(server, f"quickdraft_{n}_total") for n in ("prefix_cache_queries", "prefix_cache_hits")}
    first = chat(client, PROMPTS[1], max_tokens=8, **GREEDY).model_extra["timings"]
    again = chat(client, PROMPTS[1], max_tokens=8, **GREEDY).model_extra["timings"]
    assert again["cache_n"] == first["prompt_n"] + first["cache_n"] - 1  # its whole prompt but the last token
    assert (metric(server, "quickdraft_prefix_cache_hits_total") - before["prefix_cache_hits"]
            == first["cache_n"] + again["cache_n"])
    assert (metric(server, "quickdraft_prefix_cache_queries_total") - before["prefix_cache_queries"]
            == first["prompt_n"] + first["cache_n"] + again["prompt_n"] + again["cache_n"])  # the whole prompts
    assert metric(server, "quickdraft_prefix_cache_bytes") > 0 and metric(server, "quickdraft_prefix_cache_evictions") >= 0
    slots = server.get("/slots").json()
    assert slots and all(set(s) == {"id", "is_processing", "n_ctx", "n_tokens", "n_prompt_last", "last_used", "bytes"}
                         for s in slots)
    assert max(s["n_tokens"] for s in slots) >= again["cache_n"] and not any(s["is_processing"] for s in slots)


def test_more_conversations_are_kept_than_run_at_once(client):
    """On the CPU the kept slots are bounded by bytes, not by --parallel: six conversations one after another (four
    run at once), then the first again: its whole prompt (but the last token) is taken from its slot."""
    prompts = [f"Conversation {i}: name three {thing}." for i, thing in
               enumerate(("rivers", "colours", "metals", "birds", "planets", "trees"))]
    for text in prompts:
        chat(client, text, max_tokens=4, **GREEDY)
    again = chat(client, prompts[0], max_tokens=4, **GREEDY).model_extra["timings"]
    assert again["prompt_n"] == 1, again  # prefilled: its last token alone


def test_metrics_count_drafted_and_accepted_tokens(client, server):
    before = {n: metric(server, f"quickdraft_{n}_total") for n in
              ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "generation_tokens")}
    r = chat(client, PROMPTS[0], max_tokens=24, extra_body={"speculative": {"draft_max": 3, "adaptive": False}},
             **GREEDY)
    t = r.model_extra["timings"]
    assert metric(server, "quickdraft_spec_decode_num_draft_tokens_total") - before["spec_decode_num_draft_tokens"] == t["draft_n"]
    assert (metric(server, "quickdraft_spec_decode_num_accepted_tokens_total")
            - before["spec_decode_num_accepted_tokens"]) == t["draft_n_accepted"]
    assert metric(server, "quickdraft_generation_tokens_total") - before["generation_tokens"] == r.usage.completion_tokens
    assert metric(server, "quickdraft_e2e_request_latency_seconds_count") >= 1
