"""The Python API (quickdraft.load / LLM) and the draft description: the README's example runs as written and
says what the command line says; one spelling for each kind of draft."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import quickdraft
from quickdraft.errors import QuickdraftError
from quickdraft.speculative.draft import Draft
from quickdraft.weights import hub
from tests.helpers import cli, run, tiny_hf_model, write_gguf_from_hf

README = Path(__file__).resolve().parents[1] / "README.md"


def test_each_kind_of_draft_has_one_spelling():
    for text in ("none", "auto", "ngram", "qwen2.5-coder-0.5b", "ngram+qwen2.5-coder-0.5b", "ngram+./d.gguf"):
        assert str(Draft.parse(text)) == text
    assert Draft.parse("./d.gguf", ngram=True) == Draft.parse("ngram+./d.gguf")  # --ngram says the same
    assert Draft.parse("ngram", ngram=True) == Draft("ngram")
    with pytest.raises(QuickdraftError, match=r"write ngram\+d.gguf"):
        Draft.parse("d.gguf+ngram")
    with pytest.raises(QuickdraftError, match="use draft ngram for lookup alone"):
        Draft.parse("none", ngram=True)
    with pytest.raises(QuickdraftError, match="empty draft"):
        Draft.parse(" ")


def test_auto_is_the_targets_own_pairing():
    assert Draft.parse("auto").resolve(hub.DEFAULT_TARGET) == Draft.parse(f"suffix,{hub.DEFAULT_DRAFT}")
    assert Draft.parse("auto").resolve(str(hub.model_path(hub.DEFAULT_TARGET))) == Draft.parse(
        f"suffix,{hub.DEFAULT_DRAFT}")  # the pulled file is the alias
    assert Draft.parse("auto").resolve("./other.gguf") == Draft("none")
    assert Draft.parse("auto", ngram=True).resolve("./other.gguf") == Draft("ngram")
    assert Draft.parse("ngram").resolve(hub.DEFAULT_TARGET) == Draft("ngram")  # only auto is resolved


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf_from_hf(tiny_hf_model("llama", logit_scale=4), tmp_path_factory.mktemp("api") / "tiny.gguf")


def test_the_api_says_what_generate_says(tiny):
    llm = quickdraft.load(str(tiny), f"ngram+{tiny}", dtype="bfloat16", context=128, progress=False)
    assert llm.engine.drafter_name == f"ngram+{tiny}" and llm.draft == Draft.parse(f"ngram+{tiny}")
    out = llm.generate("hello hello hello", max_tokens=12, temperature=0, stop_at_eos=False)
    r = cli("generate", "-m", str(tiny), "-p", "hello hello hello", "-n", "12", "--ignore-eos", "--json",
            "--dtype", "bfloat16", "--ctx", "128", "--draft", f"ngram+{tiny}")
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout)
    assert out.tokens == said["tokens"] and out.text == said["text"] and out.finish_reason == said["finish_reason"]
    assert out.to_dict()["spec"]["drafter"] == said["spec"]["drafter"] == f"ngram+{tiny}"
    assert out.stats.rounds > 0
    events = list(llm.stream("hello hello hello", max_tokens=12, temperature=0, stop_at_eos=False))
    assert [e.token for e in events[:-1]] == out.tokens and events[-1].finish_reason == "length"
    plain = llm.generate("hello hello hello", max_tokens=12, temperature=0, stop_at_eos=False,
                         speculation=quickdraft.SpeculationConfig(draft_max=0))
    assert plain.tokens == out.tokens and plain.stats.drafter == "none"  # speculation changed nothing
    with pytest.raises(QuickdraftError, match="either a prompt or chat messages"):
        llm.generate()


def test_generate_defaults_to_auto_and_none_turns_it_off(tiny):
    """auto is none for a target without a paired draft: the same output as --draft none (the default pair's
    case is the slow test below)."""
    common = ["generate", "-m", str(tiny), "-p", "hi", "-n", "4", "--json", "--ignore-eos"]
    auto, none = json.loads(cli(*common).stdout), json.loads(cli(*common, "--draft", "none").stdout)
    assert auto["tokens"] == none["tokens"] and auto["spec"] is None and none["spec"] is None
    assert cli(*common, "--draft", "auto").returncode == 0
    llm = quickdraft.load(str(tiny), None, context=64, progress=False)  # Python's "none", as the CLI's dtype
    assert llm.draft == Draft.parse("none")
    assert llm.generate("hi", max_tokens=4, temperature=0, stop_at_eos=False).tokens == none["tokens"]


def readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readme_example_runs_and_matches_the_command_line(real_model_path):
    real_model_path(hub.DEFAULT_TARGET), real_model_path(hub.DEFAULT_DRAFT)
    code = readme_example()
    assert "quickdraft.load(" in code
    example = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert example.returncode == 0, example.stderr
    *text_lines, figures = example.stdout.rstrip("\n").split("\n")
    accepted, drafted = map(int, re.match(r"(\d+)/(\d+) drafts accepted", figures).groups())
    assert drafted > 0 and accepted > 0  # it speculated, and drafts landed
    given = {}  # the example's prompt: the lines that build it
    exec("\n".join(line for line in code.splitlines() if line.startswith(("code = ", "prompt = "))), given)
    prompt = given["prompt"]
    max_tokens = re.search(r"max_tokens=(\d+)", code).group(1)
    shown = run("generate", "--chat", "-p", prompt, "-n", max_tokens)  # -m and --draft: the defaults
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.rstrip("\n") == "\n".join(text_lines).rstrip("\n")
    said = rf"spec\[suffix,{re.escape(hub.DEFAULT_DRAFT)}\]: [1-9]\d*/[1-9]\d* drafts accepted"
    assert re.search(said, shown.stderr), \
        shown.stderr  # the acceptance on stderr (--json carries it as "spec": tests/test_cli.py); that the text is
    # plain decoding's is tests/test_spec_real.py's (its equality tests, and verify on the default pair)


def test_the_cache_line_offers_only_what_fits_the_context_and_the_slots():
    """serve's cache line: with a context of 2048, no "conversations of 4096 tokens", and never more whole contexts
    than kept sequences (KEPT_MAX)."""
    from types import SimpleNamespace

    from quickdraft.api import LLM

    def line(context: int, budget: int) -> str:
        slots = SimpleNamespace(budget=budget, count=64, host=None)
        engine = SimpleNamespace(slots=slots, cache=SimpleNamespace(position_bytes=lambda: 1000), drafter=None)
        return LLM.cache_summary(SimpleNamespace(engine=engine, context=context))

    small = line(2048, 2**30)
    assert "4096" not in small and "64 of the whole context (2048)" in small
    assert "conversations of 4096 tokens" in line(32768, 2**30) and "32 of the whole context" in line(32768, 2**30)
