"""quickdraft's bench --url, verify --url and tune --export against llama.cpp's own llama-server, built once from the
source llama-cpp-python 0.3.36 vendors (quickdraft/tools/llamacpp.py: about 10 minutes on 2 cores, then cached), on the
default pair's GGUF files. Slow: the build, and real models."""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from quickdraft.tools import remote
from quickdraft.tools.prompts import PROMPTS as BUNDLED
from quickdraft.tools.servers import LlamaServer, ServerProcess
from tests.server_process import Together

pytestmark = pytest.mark.slow
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = "code-en,qa-en,summary-en"


@pytest.fixture(scope="module")
def binary():
    """llama-server where it is built (the benchmarks build it: about 10 minutes on 2 cores, then cached), or built now
    with QUICKDRAFT_BUILD_LLAMACPP=1; the suite does not build it otherwise (its recorded answers are checked by
    tests/test_hybrid_gguf.py and tests/test_real_models.py)."""
    from quickdraft.tools import llamacpp

    if not llamacpp.built("llama-server") and os.environ.get("QUICKDRAFT_BUILD_LLAMACPP") != "1":
        pytest.skip("llama-server is not built here: QUICKDRAFT_BUILD_LLAMACPP=1 builds it (about 10 minutes), as "
                    "scripts/bench_llamacpp.py and scripts/bench_conversation.py do")
    if not shutil.which("cmake"):
        pytest.skip("no cmake: llama-server cannot be built here")
    return llamacpp.server_binary()


def cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "quickdraft", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tuned(real_model_path, tmp_path_factory):
    """quickdraft tune on the default pair, exported as llama-server flags. Chains alone (--draft-tree 1): llama-server
    verifies no trees (a tuned tree exports its chain's flags), and measuring and checking trees took a fifth of
    tune's time. The cut head stays a candidate: without it the whole head alone may be predicted no faster than
    plain decoding on a slow machine, leaving nothing to export."""
    real_model_path(TARGET)
    real_model_path(DRAFT)
    profile = tmp_path_factory.mktemp("tune") / "profile.json"
    r = cli("tune", "-m", TARGET, "--draft", DRAFT, "--prompts", PROMPTS, "-n", "48", "--kmax", "8",
            "--draft-tree", "1", "--profile", str(profile), "--export", "llama-server")
    assert r.returncode == 0, r.stderr[-3000:]
    (command,) = [line for line in r.stdout.splitlines() if line.startswith("llama-server ")]
    return profile, shlex.split(command)[1:], r.stdout


@pytest.fixture(scope="module")
def servers(binary, tuned, real_model_path):
    """llama-server plain, llama-server with the exported flags (as they are: it must accept them), and quickdraft serve
    with the same profile, started at once: their loads overlap on two cores as they could not one after another."""
    target = str(real_model_path(TARGET))
    started = Together.of(lambda: LlamaServer(binary, "-m", target),
                          lambda: LlamaServer(binary, *tuned[1]),
                          lambda: ServerProcess("-m", TARGET, "--profile", str(tuned[0]), "--ctx", "2048"))
    try:
        yield started.servers
    finally:
        started.stop()


def test_bench_url_with_and_without_its_draft(servers):
    plain, spec, _ = servers
    endpoints = [remote.Endpoint(plain.url), remote.Endpoint(spec.url)]
    # one run, no warm-up: what is asserted is read from each reply (its draft figures, its timing fields), not a speed
    result = remote.bench(endpoints, {"code-en": "Write a Python function that merges two sorted lists."}, 48,
                          runs=1, warmup=0)
    rows = {r["url"]: r for r in result["rows"]}
    assert rows[plain.url]["drafted"] is None  # llama-server reports no draft figures without a draft
    assert rows[spec.url]["drafted"] > 0 and rows[spec.url]["accepted"] > 0
    assert all(set(r["decode_tok_s"]) == set(r["ttft_ms"]) == {"median", "min", "max"} for r in rows.values())
    print(remote.bench_table(result))


def test_verify_reports_what_llama_servers_speculation_does(servers):
    plain, spec, _ = servers
    prompts = {"qa-en": "What causes the seasons on Earth? Answer in a short paragraph.",
               "code-en": "Write a Python function that merges two sorted lists into one sorted list."}
    itself = remote.verify(remote.Endpoint(plain.url), remote.Endpoint(plain.url), dict(list(prompts.items())[:1]), 24)
    assert itself["identical"]  # plain against itself, on one prompt and 24 tokens: the comparison itself is sound
    result = remote.verify(remote.Endpoint(spec.url), remote.Endpoint(plain.url), prompts, 48)
    text = remote.verify_report(result)
    print(text)
    assert ("IDENTICAL" in text.splitlines()[-1]) and all(g["drafted"] for g in result["greedy"])
    # llama-server gives no logprobs for drafted tokens: the comparison falls back to text
    assert all(g["unit"] == "character" for g in result["greedy"])


def test_exported_flags_reproduce_the_acceptance_quickdraft_sees_with_the_same_profile(servers):
    """The same profile on both engines, the same prompts and method: the share of drafted tokens kept agrees
    within 20 points (the engines' outputs part at near ties, and llama.cpp's p-min stops drafts differently)."""
    _, spec, ours = servers  # ours serves with tune's profile
    prompts = {name: BUNDLED[name] for name in PROMPTS.split(",")}
    result = remote.bench([remote.Endpoint(spec.url), remote.Endpoint(ours.url)], prompts, 64, runs=1,
                          warmup=0)  # the shares count the measured runs alone: a warm-up adds no draft to them
    shares = {}
    for url in (spec.url, ours.url):
        rows = [r for r in result["rows"] if r["url"] == url]
        shares[url] = sum(r["accepted"] for r in rows) / sum(r["drafted"] for r in rows)
    print(remote.bench_table(result), shares)
    assert abs(shares[spec.url] - shares[ours.url]) < 0.2, shares
