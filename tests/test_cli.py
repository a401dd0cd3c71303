"""The command line on tiny models: output shapes, and bad input as one clear line with a non-zero exit."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from tests.helpers import assert_one_line_error, cli, run, tiny_hf_model, write_gguf_from_hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf_from_hf(tiny_hf_model("llama"), tmp_path_factory.mktemp("cli") / "tiny.gguf")


def test_generate_json(tiny_gguf):
    r = cli("generate", "-m", str(tiny_gguf), "-p", "hello world", "-n", "5", "--json", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 5 and out["prompt_tokens"] == len("hello world")
    assert out["finish_reason"] == "length"
    assert set(out["timings"]) >= {"ttft_s", "prefill_tok_s", "decode_tok_s", "n_decoded"}
    assert out["timings"]["n_decoded"] == 4


def test_generate_streams_text_then_timings(tiny_gguf):
    args = ("generate", "-m", str(tiny_gguf), "-p", "hi", "-n", "3", "--temp", "0.8", "--seed", "1")
    with ThreadPoolExecutor(2) as pool:  # two processes at once (each mostly an interpreter importing torch)
        r, again = pool.map(lambda _: run(*args), range(2))
    assert r.returncode == 0, r.stderr
    assert "TTFT" in r.stderr and "decode" in r.stderr and "prefill" in r.stderr
    assert again.returncode == 0 and again.stdout == r.stdout  # seeded sampling is reproducible


def test_missing_model_file():
    assert_one_line_error(cli("generate", "-m", "/nonexistent/model.gguf", "-p", "x"), "not found")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model")
    assert_one_line_error(cli("generate", "-m", str(bad), "-p", "x"), "not a readable GGUF")


def test_unsupported_architecture(tmp_path):
    path = write_gguf_from_hf(tiny_hf_model("llama"), tmp_path / "m.gguf", arch="gpt99")
    assert_one_line_error(cli("generate", "-m", str(path), "-p", "x"), "unsupported architecture 'gpt99'",
                          "quickdraft runs", "llama", "gemma3", "phi3")


def test_unsupported_tensor_type(tmp_path):
    raw = np.zeros((4, GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8)
    path = write_gguf_from_hf(tiny_hf_model("llama"), tmp_path / "m.gguf",
                              extra_tensors=[("blk.0.extra.weight", raw, T.Q2_K)])
    assert_one_line_error(cli("generate", "-m", str(path), "-p", "x"), "Q2_K")


def test_prompt_longer_than_context(tiny_gguf):
    r = cli("generate", "-m", str(tiny_gguf), "-p", "x" * 100, "--ctx", "32", "-n", "4")
    assert_one_line_error(r, "fills the context of 32 tokens: shorten it, or raise --ctx (the model takes up to")


def test_an_error_names_the_setting_as_each_front_end_calls_it():
    """The core names a setting by the library's keyword; the command line writes its flag, the server its field."""
    from quickdraft.config import SpeculationConfig
    from quickdraft.errors import QuickdraftError
    from quickdraft.server.protocol import say as server_says
    from quickdraft.tools.flags import say as cli_says

    with pytest.raises(QuickdraftError) as e:
        SpeculationConfig(draft_max=2, draft_min=3)
    assert str(e.value) == "draft_min and draft_max must satisfy 0 <= draft_min <= draft_max"
    assert cli_says(e.value) == "--draft-min and --draft-max must satisfy 0 <= --draft-min <= --draft-max"
    assert server_says(e.value).startswith("speculative.draft_min and speculative.draft_max must satisfy")
    assert_one_line_error(cli("generate", "-m", "x.gguf", "-p", "x", "--draft-max", "2", "--draft-min", "3"),
                          "--draft-min and --draft-max must satisfy")


def test_unknown_alias_and_bad_device(tiny_gguf):
    assert_one_line_error(cli("pull", "no-such-model"), "unknown model alias")
    assert_one_line_error(cli("generate", "-m", str(tiny_gguf), "-p", "x", "--device", "tpu"), "--device")


def test_debug_shows_the_traceback():
    r = run("generate", "-m", "/nonexistent/model.gguf", "-p", "x", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_perplexity_json(tiny_gguf, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh " * 20)
    r = cli("perplexity", "-m", str(tiny_gguf), "-f", str(text), "--ctx", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens"] == 2 * (64 - 32 - 1) and out["ppl"] > 1
    short = cli("perplexity", "-m", str(tiny_gguf), "-f", str(text), "--ctx", "4096")
    assert_one_line_error(short, "fewer than --ctx")


def test_generate_with_a_draft_reports_spec(tiny_gguf, tmp_path):
    draft = write_gguf_from_hf(tiny_hf_model("llama", seed=5), tmp_path / "draft.gguf")
    args = ["generate", "-m", str(tiny_gguf), "-p", "hello hello hello", "-n", "12", "--json", "--ignore-eos",
            "--dtype", "bfloat16"]
    plain = json.loads(cli(*args).stdout)
    for draft_args in (["--draft", str(draft), "--draft-max", "3", "--fixed-k"], ["--draft", "ngram"],
                       ["--draft", str(draft), "--ngram"]):
        r = cli(*args, *draft_args)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["tokens"] == plain["tokens"]
        spec = out["spec"]
        assert {"draft_n", "draft_n_accepted", "acceptance_rate", "mean_accepted_length",
                "accept_per_position", "k_history", "draft_device", "draft_s", "verify_s"} <= set(spec)
    assert plain["spec"] is None


def test_incompatible_draft_is_refused(tiny_gguf, tmp_path):
    other = write_gguf_from_hf(tiny_hf_model("llama", vocab=330), tmp_path / "other.gguf")
    r = cli("generate", "-m", str(tiny_gguf), "-p", "x", "--draft", str(other))
    assert_one_line_error(r, "330 tokens and the target's 320", "10 belong to one alone")


def test_serve_on_a_taken_port_is_one_line_before_any_load(tiny_gguf):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(run("serve", "-m", str(tiny_gguf), "--port", str(port)), "cannot listen", "--port")


def test_generate_with_a_constraint(tmp_path):
    gguf = write_gguf_from_hf(tiny_hf_model("llama", logit_scale=4), tmp_path / "eos.gguf", eos=True)
    r = cli("generate", "-m", str(gguf), "-p", "mail: ", "-n", "30", "--regex", "[a-c]{2,4}@x\\.org",
            "--draft", str(gguf), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop" and re.fullmatch("[a-c]{2,4}@x\\.org", out["text"]), out["text"]
    assert out["spec"]["constraint"] == "regex" and out["spec"]["masks_computed"] > 0
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "nosuch"}}}')
    assert_one_line_error(cli("generate", "-m", str(gguf), "-p", "x", "--json-schema", str(schema)),
                          "invalid JSON schema", "nosuch")
    assert_one_line_error(cli("generate", "-m", str(gguf), "-p", "x", "--regex", "a("),
                          "invalid regular expression", "unclosed group")


def test_a_draft_window_out_of_range_is_one_line(tiny_gguf):
    assert_one_line_error(cli("generate", "-m", str(tiny_gguf), "-p", "x", "--draft-window", "-1"),
                          "--draft-window must be 0 (the whole context) or a number of tokens")
    assert_one_line_error(cli("generate", "-m", str(tiny_gguf), "-p", "x", "--ctx", "64", "--draft", str(tiny_gguf),
                              "--draft-window", "100"), "--draft-window 100 is beyond the context of 64 tokens")


def test_settings_that_mean_nothing_here_are_one_line(tiny_gguf, tmp_path):
    """A draft directory whose config.json is not JSON names the file (an error like any other: exit 1); a window
    for a draft without a draft model is refused; a negative context is refused, and 0 is the model's own."""
    bad = tmp_path / "draft"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    r = cli("generate", "-m", str(tiny_gguf), "-p", "x", "--draft", str(bad))
    assert_one_line_error(r, f"{bad / 'config.json'} is not valid JSON (line 1, column 2")
    assert r.returncode == 1
    assert_one_line_error(cli("generate", "-m", str(tiny_gguf), "-p", "x", "--draft", "ngram", "--draft-window",
                              "64"), "--draft-window is the context a draft model drafts from, and --draft ngram has "
                                     "no draft model")
    assert_one_line_error(cli("generate", "-m", str(tiny_gguf), "-p", "x", "--ctx", "-5"), "--ctx -5: give a number")
    r = cli("generate", "-m", str(tiny_gguf), "-p", "hello", "-n", "3", "--ctx", "0", "--json")
    assert r.returncode == 0, r.stderr
