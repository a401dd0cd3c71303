"""llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf with their .inp/.out: texts and the ids llama.cpp
and transformers give them), on quickdraft's tokenizers built from those vocabulary-only GGUF files: every
vocabulary llama.cpp ships vectors for, every vector."""

import pytest

from quickdraft.tokenizer import Tokenizer
from quickdraft.weights import gguf as gguf_io
from tests import llamacpp

VOCABS = ["llama-spm", "llama-bpe", "phi-3", "qwen2", "qwen35", "gemma-4", "deepseek-llm", "deepseek-coder",
          "command-r", "starcoder", "gpt-2", "falcon", "mpt", "refact", "bert-bge"]


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request):
    path = llamacpp.tree() / "models" / f"ggml-vocab-{request.param}.gguf"
    return request.param, Tokenizer.from_gguf_metadata(gguf_io.metadata(gguf_io.open_gguf(path)))


def test_every_vector_gives_llama_cpps_ids(vocab):
    name, tokenizer = vocab
    cases = llamacpp.vocab_tests(name)
    assert len(cases) >= 46
    wrong = [(text, want, got) for text, want in cases if (got := tokenizer.encode(text, add_bos=False)) != want]
    assert not wrong, f"{name}: {len(wrong)} of {len(cases)} differ, first {wrong[0]}"


def test_decoding_gives_the_text_back(vocab):
    name, tokenizer = vocab
    if name == "bert-bge":
        pytest.skip("WordPiece lowercases and drops accents and spacing: not invertible")
    for text, ids in llamacpp.vocab_tests(name):
        if ids and text.isprintable() and text.strip() == text and "  " not in text:
            assert tokenizer.decode(ids) == text, (name, text)


def test_tokenize_command_prints_llama_cpps_ids():
    """`quickdraft tokenize` on a vocabulary-only file: the ids llama.cpp gives, and pieces that spell the text."""
    import json

    from tests.helpers import cli

    path = llamacpp.tree() / "models" / "ggml-vocab-llama-bpe.gguf"
    text, want = next((t, ids) for t, ids in llamacpp.vocab_tests("llama-bpe") if len(ids) > 5 and t.isprintable())
    result = cli("tokenize", "-m", str(path), "--no-bos", "--json", text)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["ids"] == want
    assert "".join(out["pieces"]) == text
    listed = cli("tokenize", "-m", str(path), "--no-bos", text)
    assert [int(line.split("->")[0]) for line in listed.stdout.splitlines()] == want
    assert f"{len(want)} tokens" in listed.stderr
