"""A long prompt must not hold the server: against a real server process on a real small model (SmolLM2-135M), a
lone prompt's prefill runs a chunk per step, so a short request that arrives meanwhile is prefilled beside it (the
shortest first) and a client that leaves stops it at the next chunk; on the CPU the kept conversations' caches take
memory as they fill, so many short conversations keep their prefixes in the memory that held two whole contexts.
Each of these was a defect found by an attack run, and each test here failed before its fix."""

import threading
import time

import httpx
import pytest

from tests import loopback
from tests.server_process import Together, metric

MODEL = "smollm2-135m"
SENTENCE = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. "
LONG = SENTENCE * 110  # about 2,000 tokens: 32 chunks of 64
pytestmark = pytest.mark.slow


def complete(server, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    r = loopback.post(server.url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def first_token_at(server, prompt: str, out: dict, key: str) -> None:
    """Stream a completion of prompt; out[key] = the time its first token arrived."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "cache_prompt": False}
    with loopback.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                out[key] = time.perf_counter()
                return


@pytest.fixture(scope="module")
def servers(real_model_path):
    """The module's server and the last test's (kept conversations under --cache-ram, three at once), started at
    once and stopped at once: their starts overlap (tests/server_process.Together)."""
    real_model_path(MODEL)
    started = Together(("-m", MODEL, "--draft", "none", "--ctx", "4096"),
                       ("-m", MODEL, "--draft", "none", "--ctx", "4096", "--cache-ram", "190M", "--parallel", "3"),
                       startup_timeout=300)
    yield started.servers
    started.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def test_a_short_request_behind_a_long_prompt_is_answered_first(server):
    """The long prompt is being prefilled (a chunk a step); a short one sent meanwhile gets its first token before
    the long one does (it waited for the whole prefill when a lone sequence prefilled in one step)."""
    times: dict = {}
    long = threading.Thread(target=first_token_at, args=(server, LONG, times, "long"))
    long.start()
    time.sleep(0.5)
    sent = time.perf_counter()
    first_token_at(server, "Say hello.", times, "short")
    long.join()
    assert times["short"] < times["long"], (times["short"] - sent, times["long"] - sent)
    print(f"\nshort request's first token {times['short'] - sent:.2f} s after it was sent; the long prompt's "
          f"{times['long'] - sent:.2f} s")


def test_a_client_that_leaves_during_a_prefill_stops_it_at_the_next_chunk(server):
    """A request whose client goes away half a second into a long prefill ends at the next step: the engine runs
    a few more passes, not the rest of the prefill (32 chunks of 64 rows)."""
    headers = {}
    passes = lambda: metric(server.url, headers, "quickdraft_batch_rows_count")  # noqa: E731
    before = passes()
    body = {"prompt": LONG + "Once more: ", "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    try:
        loopback.post(server.url + "/v1/completions", json=body, timeout=0.5)
    except httpx.TimeoutException:
        pass  # the client is gone
    deadline = time.perf_counter() + 30
    while metric(server.url, headers, "quickdraft_num_requests_running") > 0 and time.perf_counter() < deadline:
        time.sleep(0.05)
    ran = passes() - before
    assert metric(server.url, headers, "quickdraft_num_requests_running") == 0
    assert ran < 16, f"{ran} passes ran for a request whose client left after 0.5 s"


def test_conversations_keep_their_prefixes_in_the_memory_two_whole_contexts_took(servers):
    """--cache-ram the size of two 4k-token caches held two kept sequences; caches that take memory as they fill
    hold the eight 550-token conversations of three clients, and every second turn reuses its first."""
    server = servers[1]
    assert any(line.startswith("cache: ") for line in server.printed)
    turns: dict = {}

    def client(conversations: list[int]) -> None:
        for c in conversations:
            prompt = f"Conversation {c}. " + SENTENCE * 30
            first = complete(server, prompt, 8)
            turns[c] = (prompt + first["choices"][0]["text"], first["usage"]["prompt_tokens"])
        for c in conversations:
            history, n = turns[c]
            again = complete(server, history + " And then?", 8)
            turns[c] = (again["timings"]["cache_n"], n)

    threads = [threading.Thread(target=client, args=([i, i + 3, i + 6][:3 - (i == 2)],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(turns) == 8
    assert all(cache_n >= n for cache_n, n in turns.values()), turns
