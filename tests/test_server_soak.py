"""A soak of misbehaving clients, bounded in time and count, on loopback: valid requests (streamed or not, with
speculation or without, constrained or not) among invalid bodies, slow connections, requests abandoned in the
queue and streams cancelled mid-way. Afterwards nothing is left over (event-loop tasks, file descriptors), memory
is back within a bound, every valid answer is its own prompt's, and /health answered quickly throughout."""

import json
import random
import statistics
import threading
import time

import httpx
import psutil
import pytest

from tests import loopback
from tests.helpers import tiny_hf_model, write_gguf_from_hf
from quickdraft.tools.servers import ServerProcess
from tests.server_process import HealthWatch, event_loop_tasks, raw_socket, request_bytes

pytestmark = pytest.mark.slow  # 12 s of clients

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
SOAK_S = 12  # the chaos itself (10 clients: some hundreds of requests); the whole test takes about 20 s more
REQUEST_TIMEOUT_S = 3  # the server's head deadline
CLIENTS = 10
PROMPTS = [f"soak prompt {i}: {'abc' * i}" for i in range(6)]
VARIANTS = {  # speculation on (n-gram), off, and on under a constraint
    "ngram": {}, "plain": {"speculative": {"draft_max": 0}}, "regex": {"regex": "[a-z ]{4,16}"},
}
JSON = {"Content-Type": "application/json"}
INVALID = [  # (body bytes, headers)
    (b'{"prompt": ', JSON), (b'{"prompt": "x", "nosuch": 1}', JSON), (b'{"prompt": "x", "\\ud800": 1}', JSON),
    (b'{"prompt": "x"}', {"Content-Type": "text/plain", "Origin": "https://elsewhere.example"}),  # a foreign page
    (json.dumps({"messages": [{"role": "user", "content": [{}] * 600}] * 200}).encode(), JSON),
    (json.dumps({"prompt": "x", "grammar": "root ::= nothere"}).encode(), JSON),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("soak")
    path = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=5), d / "tiny.gguf", eos=True)
    with ServerProcess("-m", str(path), "--draft", "ngram", "--ctx", "512", "--max-queue", "8", "--api-key", KEY,
                       "--dtype", "float32", "--request-timeout", str(REQUEST_TIMEOUT_S), startup_timeout=120) as s:
        yield s


def body(prompt: str, variant: str, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream,
            **VARIANTS[variant]}


def answer(client: httpx.Client, url: str, prompt: str, variant: str, stream: bool) -> tuple[int, str | None]:
    """(HTTP status, the completion's text when 200)."""
    if not stream:
        r = client.post(url + "/v1/completions", json=body(prompt, variant), headers=AUTH)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else None
    with client.stream("POST", url + "/v1/completions", json=body(prompt, variant, True), headers=AUTH) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return 200, "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


class Tally:
    def __init__(self):
        self.lock, self.counts, self.problems = threading.Lock(), {}, []

    def add(self, name: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + 1
            if problem:
                self.problems.append(problem)


def client_loop(url: str, references: dict, deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.choice(["valid", "valid", "stream", "invalid", "slow", "abandoned", "cancelled"])
            prompt, variant = rng.choice(PROMPTS), rng.choice(list(VARIANTS))
            try:
                if kind in ("valid", "stream"):
                    status, text = answer(client, url, prompt, variant, kind == "stream")
                    if status == 503:
                        tally.add("busy")
                    elif status != 200:
                        tally.add("lost", f"{kind} {variant}: HTTP {status}")
                    else:
                        tally.add("answers", None if text == references[prompt, variant] else
                                  f"mixed: {prompt!r} {variant} got {text!r}, not {references[prompt, variant]!r}")
                elif kind == "invalid":
                    data, headers = rng.choice(INVALID)
                    r = client.post(url + "/v1/completions", content=data, headers={**AUTH, **headers})
                    if r.status_code == 503 and b'"grammar"' in data:  # a full queue is said before compiling
                        tally.add("busy")
                    else:
                        tally.add("refused", None if 400 <= r.status_code < 500 else
                                  f"invalid body: HTTP {r.status_code}")
                elif kind == "slow":  # a head a few bytes at a time, then gone
                    s = raw_socket(url, b"GET /health HTTP/1.1\r\n")
                    for _ in range(3):
                        time.sleep(0.2)
                        s.sendall(b"X")
                    s.close()
                    tally.add("slow")
                else:  # abandoned (whatever state it reached) or a stream cancelled after its first bytes
                    s = raw_socket(url, request_bytes(body(prompt, variant, stream=kind == "cancelled"), KEY))
                    if kind == "cancelled":
                        s.recv(100)
                    else:
                        time.sleep(rng.uniform(0, 0.3))
                    s.close()
                    tally.add(kind)
            except (httpx.HTTPError, OSError) as e:
                tally.add("lost", f"{kind}: {type(e).__name__}: {e}")


def settle(url: str) -> None:
    deadline = time.monotonic() + 30
    while loopback.get(url + "/health", timeout=30).json() != {"status": "ok", "waiting": 0, "running": False}:
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.1)


def left_over(url: str, proc: psutil.Process, before: dict) -> dict:
    """Event-loop tasks and file descriptors once back at their counts before (or as they are REQUEST_TIMEOUT_S + 5 s
    on): a connection its client closed is closed by the server at the head deadline at the latest."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S + 5
    while True:
        now = {"tasks": event_loop_tasks(url, AUTH), "fds": proc.num_fds()}
        if (now["tasks"] <= before["tasks"] and now["fds"] <= before["fds"]) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_a_soak_of_misbehaving_clients_leaves_nothing_behind(server):
    url, proc = server.url, psutil.Process(server.pid)
    with httpx.Client(timeout=120) as client:  # each prompt's own answer, one request at a time
        references = {(p, v): answer(client, url, p, v, False)[1] for p in PROMPTS for v in VARIANTS}
    settle(url)
    before = {"tasks": event_loop_tasks(url, AUTH), "fds": proc.num_fds(), "rss": proc.memory_info().rss}
    tally = Tally()
    with HealthWatch(url, every_s=0.05) as health:
        deadline = time.monotonic() + SOAK_S
        clients = [threading.Thread(target=client_loop, args=(url, references, deadline, i, tally))
                   for i in range(CLIENTS)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
    latencies = health.latencies
    settle(url)
    after = {**left_over(url, proc, before), "rss": proc.memory_info().rss}
    p99 = statistics.quantiles(latencies, n=100)[98]
    counts = tally.counts
    mixed = sum(p.startswith("mixed") for p in tally.problems)
    print(f"\nsoak: {CLIENTS} clients for {SOAK_S} s, {sum(counts.values())} requests: {json.dumps(counts)}; "
          f"answers {counts.get('answers', 0)}, lost {counts.get('lost', 0)}, mixed {mixed}; event-loop tasks "
          f"{before['tasks']} -> {after['tasks']} (left {after['tasks'] - before['tasks']}), file descriptors "
          f"{before['fds']} -> {after['fds']}, RSS {before['rss'] >> 20} -> {after['rss'] >> 20} MiB; /health "
          f"p99 {1000 * p99:.0f} ms, worst {1000 * max(latencies):.0f} ms over {len(latencies)}")
    assert not tally.problems, tally.problems[:5]
    assert counts.get("answers", 0) > 0 and counts.get("lost", 0) == 0
    assert after["tasks"] <= before["tasks"] and after["fds"] <= before["fds"]
    assert after["rss"] < before["rss"] + (200 << 20)
    assert p99 < 2.0, "/health waited behind something that holds the event loop"
    assert server.proc.poll() is None
