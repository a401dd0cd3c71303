"""bench --url, verify --url and tune --export against real `quickdraft serve` processes on tiny random models: the
table and the verdict read from HTTP, concurrency, the servers' own speculation figures, a key sent, and one-line
errors for an unreachable URL, a server that is not OpenAI-compatible and a missing key. (llama-server itself:
tests/test_llama_server.py, slow.)"""

import http.server
import json
import shlex
import threading

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.tools import export, remote
from tests.helpers import add_noise, cli, tiny_hf_model, write_gguf_from_hf  # cli: in this process
from tests.server_process import Together

KEY = "remote-key"
PROMPTS = {"code-en": "Write a function.", "qa-en": "Why is the sky blue?"}
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("remote")
    target = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=5), d / "tiny.gguf", chat_template=TEMPLATE)
    noisy = add_noise(tiny_hf_model("llama", logit_scale=5))
    return target, write_gguf_from_hf(noisy, d / "noisy.gguf", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def deployments(files):
    """The three deployments, started at once: the target with the noisy copy drafting (drafts kept and rejected),
    the target alone, and the noisy copy alone (a different model: what a deployment that is not exact looks like to
    verify). The speculative one at a fixed k: on models this small a drafter's catch-up costs many plain steps, and
    the adaptive policy may rightly draft nothing in 24 tokens, where these tests read the drafts' figures."""
    target, noisy = files
    common = ("--ctx", "256", "--dtype", "bfloat16", "--api-key", KEY)
    started = Together(("-m", str(target), "--draft", str(noisy), "--draft-max", "3", "--fixed-k", *common),
                       ("-m", str(target), "--draft", "none", *common),
                       ("-m", str(noisy), "--draft", "none", *common), startup_timeout=120)
    yield started.servers
    started.stop()


@pytest.fixture(scope="module")
def spec(deployments):
    return deployments[0]


@pytest.fixture(scope="module")
def plain(deployments):
    return deployments[1]


@pytest.fixture(scope="module")
def other(deployments):
    return deployments[2]


def test_bench_url_compares_deployments_with_their_own_figures(spec, plain):
    r = cli("bench", "--url", spec.url, "--url", plain.url, "--api-key", KEY, "--prompts", "code-en,qa-en",
            "--runs", "2", "--warmup", "1", "-n", "24", "--metrics-url", spec.url + "/metrics")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "2 prompts x 2 runs, 24 greedy tokens" in lines[0]
    spec_rows = [line for line in lines if line.startswith(("code-en", "qa-en")) and spec.url in line]
    plain_rows = [line for line in lines if line.startswith(("code-en", "qa-en")) and plain.url in line]
    assert len(spec_rows) == len(plain_rows) == 2
    assert all("%" in line for line in spec_rows)  # the server's timings: kept of drafted
    assert all("none drafted" in line for line in plain_rows)
    assert any("Prometheus spec_decode counters" in line and "drafted tokens accepted" in line for line in lines)
    assert any(line.startswith(f"{plain.url} against {spec.url}: decode") for line in lines)


def test_bench_concurrency_reports_per_stream_and_aggregate(spec):
    # a fixed k: three streams at once are batched, where the adaptive choice may well be not to draft
    e = remote.Endpoint(spec.url, KEY, extra={"speculative": {"draft_max": 3, "adaptive": False}})
    result = remote.bench([e], {"qa-en": PROMPTS["qa-en"]}, 16, runs=1, warmup=0, concurrency=3)
    (row,) = result["rows"]
    assert set(row["aggregate_tok_s"]) == set(row["decode_tok_s"]) == {"median", "min", "max"}  # figures, not speeds
    assert row["drafted"] > 0  # three streams' timings summed
    assert "aggregate tok/s" in remote.bench_table(result)


def test_verify_url_finds_the_speculative_server_identical_to_the_plain_one(spec, plain):
    r = cli("verify", "--url", spec.url, "--reference-url", plain.url, "--api-key", KEY, "--prompts",
            "code-en,qa-en,qa-zh", "-n", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("identical, 32 tokens") == 4  # 3 greedy + seeded, token by token (logprobs tokens)
    assert "seeded (T=0.8" in r.stdout and "IDENTICAL: speculation left the output unchanged" in r.stdout


def test_verify_url_shows_where_two_deployments_part(spec, other):
    result = remote.verify(remote.Endpoint(spec.url, KEY), remote.Endpoint(other.url, KEY), PROMPTS, 32)
    assert not result["identical"]
    text = remote.verify_report(result)
    assert "DIFFERENT from token" in text and "NOT IDENTICAL" in text
    first = next(g for g in result["greedy"] if not g["same"])
    assert first["spec"] != first["reference"]


def test_an_unreachable_url_is_one_line():
    r = cli("bench", "--url", "http://127.0.0.1:9", "--runs", "1")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "cannot reach http://127.0.0.1:9" in r.stderr


def test_a_server_that_is_not_openai_compatible_is_one_line():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        r = cli("verify", "--url", url, "--reference-url", url)
        assert r.returncode == 1 and "does not answer as an OpenAI-compatible server" in r.stderr
        assert r.stderr.strip().count("\n") == 0
    finally:
        httpd.shutdown()


def test_local_only_flags_are_refused_with_url():
    r = cli("bench", "--url", "http://127.0.0.1:9", "--configs", "plain", "--roofline")
    assert r.returncode == 1 and "--configs, --roofline measure local configurations" in r.stderr


def test_the_key_is_sent_and_a_missing_one_is_named(spec):
    r = cli("bench", "--url", spec.url, "--runs", "1", "-n", "4", "--prompts", "qa-en")
    assert r.returncode == 1 and "refused the request (401): give its key with --api-key" in r.stderr


PROFILE = {"version": 2, "target": "qwen2.5-coder-1.5b", "draft": "ngram+qwen2.5-coder-0.5b", "draft_max": 5,
           "fixed_k": True, "p_min": 0.5, "predicted_speedup": 1.8, "measured_speedup": 1.7,
           "candidates": [{"name": "ngram+qwen2.5-coder-0.5b", "acceptance": [0.9, 0.8, 0.75, 0.7, 0.6, 0.5]}]}


@pytest.mark.parametrize("draft", ["ngram+qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b", "ngram"])
def test_exports_parse_as_each_engines_configuration(draft):
    profile = {**PROFILE, "draft": draft, "candidates": [{**PROFILE["candidates"][0], "name": draft}]}
    for engine in export.ENGINES:
        text = export.export(profile, engine, "/models/t.gguf", "/models/d.gguf")
        comments = [line for line in text.splitlines() if line.startswith("#")]
        assert "0.90, 0.80, 0.75, 0.70, 0.60" in "\n".join(comments) and "predicted speed-up 1.80x" in text
        (command,) = [line for line in text.splitlines() if not line.startswith("#")]
        argv = shlex.split(command)
        flags = dict(zip(argv[1::1], argv[2::1]))
        if engine == "llama-server":
            types = flags["--spec-type"].split(",")
            assert ("ngram-simple" in types) == draft.startswith("ngram")
            assert ("draft-simple" in types) == ("0.5b" in draft)
            if "0.5b" in draft:
                assert flags["-md"] == "/models/d.gguf" and flags["--spec-draft-n-max"] == "5"
            else:
                assert flags["--spec-ngram-simple-size-m"] == "5"
        elif engine == "vllm":
            config = json.loads(flags["--speculative-config"])
            assert config["num_speculative_tokens"] == 5
            assert config["method"] == ("ngram" if draft == "ngram" else "draft_model")
            if draft != "ngram":
                assert config["model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
            assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
        else:
            algorithm = flags["--speculative-algorithm"]
            assert algorithm == ("NGRAM" if draft == "ngram" else "STANDALONE")
            if algorithm == "STANDALONE":
                assert flags["--speculative-num-steps"] == "5" and flags["--speculative-num-draft-tokens"] == "6"


def test_a_tuned_tree_exports_its_chain_saying_so():
    """No engine has a flag for tree verification: a profile that chose one exports the chain's flags, and says so."""
    for engine in export.ENGINES:
        chain = export.export({**PROFILE, "draft_tree": 1}, engine, "/models/t.gguf", "/models/d.gguf")
        tree = export.export({**PROFILE, "draft_tree": 3}, engine, "/models/t.gguf", "/models/d.gguf")
        commands = [[line for line in text.splitlines() if not line.startswith("#")] for text in (chain, tree)]
        assert commands[0] == commands[1] and "no flag for" in tree and "no flag for" not in chain


def test_tune_export_from_a_written_profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    r = cli("tune", "--export", "vllm", "--from", str(path))
    assert r.returncode == 0, r.stderr
    assert '"method": "draft_model"' in r.stdout and "vLLM 0.11" in r.stdout


def test_a_chain_exports_its_order_and_one_drafter():
    """A chain with the model first exports llama-server's types in its order; vLLM and SGLang run its model and say
    that lookup is left out; two drafters beside lookup are refused for llama-server (one -md)."""
    chain = {**PROFILE, "draft": "qwen2.5-coder-0.5b,ngram", "draft_kind": "chain", "draft_kinds": ["model", "ngram"]}
    text = export.export(chain, "llama-server", "/models/t.gguf", "/models/d.gguf")
    (command,) = [line for line in text.splitlines() if not line.startswith("#")]
    flags = dict(zip(shlex.split(command)[1:], shlex.split(command)[2:]))
    assert flags["--spec-type"] == "draft-simple,ngram-simple" and flags["-md"] == "/models/d.gguf"
    for engine in ("vllm", "sglang"):
        assert "no n-gram lookup beside it" in export.export(chain, engine)
    two = {**chain, "draft": "qwen2.5-coder-0.5b,/heads/e3", "draft_kinds": ["model", "eagle3"]}
    with pytest.raises(QuickdraftError, match="loads one drafter beside lookup"):
        export.export(two, "llama-server")


def test_suffix_decoding_exports_as_vllms_suffix_method_and_as_lookup_elsewhere():
    """The default chain (suffix decoding, then the draft model): vLLM runs the model; suffix alone is vLLM's own
    suffix method with quickdraft's depth and floor; llama-server has no suffix decoding: its lookup stands in."""
    chain = {**PROFILE, "draft": "suffix,qwen2.5-coder-0.5b", "draft_kind": "chain", "draft_kinds": ["suffix", "model"]}
    text = export.export(chain, "llama-server", "/models/t.gguf", "/models/d.gguf")
    (command,) = [line for line in text.splitlines() if not line.startswith("#")]
    assert "ngram-simple,draft-simple" in command and "has no suffix decoding" in text
    alone = {**PROFILE, "draft": "suffix", "draft_kind": "suffix"}
    config = json.loads(shlex.split(export.export(alone, "vllm").splitlines()[-1])[-1])
    assert config["method"] == "suffix" and config["suffix_decoding_max_tree_depth"] == 24
