"""Our tokenizers (built from GGUF metadata) give the same ids as transformers' on real vocabularies."""

import pytest

from quickdraft.tokenizer import Tokenizer
from quickdraft.weights import gguf as gguf_io

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "It's 2026; we'll see—they've said 12,345.67 isn't 1e-9.",
    "人工智能正在改变世界。你好，世界！请用中文回答这个问题。",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "emoji: 😀👍🏽🚀 and ✨ flags 🇫🇷 zwj 👨‍👩‍👧",
    "   leading spaces\n\n\n\ttabs\t\tand    runs   \r\n trailing   ",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
    "",
]

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b"]


@pytest.fixture(scope="module", params=MODELS)
def tokenizers_pair(request, real_model_path, tmp_path_factory):
    from transformers import AutoTokenizer

    path = real_model_path(request.param)
    ours = Tokenizer.from_gguf_metadata(gguf_io.metadata(gguf_io.open_gguf(path)))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return request.param, ours, reference


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_reference(tokenizers_pair, text):
    _, ours, reference = tokenizers_pair
    want = reference(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, add_bos=False) == want
    assert ours.decode(want) == reference.decode(want)


def test_chat_template_renders_like_transformers(tokenizers_pair):
    _, ours, reference = tokenizers_pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sort a list in Python."}]
    for add in (True, False):
        want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == want


def test_hf_directory_tokenizer(tokenizers_pair, tmp_path):
    """The tokenizer.json path: the reference saved as a Hugging Face directory loads to the same ids."""
    _, ours, reference = tokenizers_pair
    reference.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text, add_bos=False) == ours.encode(text, add_bos=False)
    messages = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_end_of_generation_tokens(tokenizers_pair):
    name, ours, _ = tokenizers_pair
    im_end = ours.backend.token_to_id("<|im_end|>")
    assert im_end in ours.eos_ids
    assert all(ours.token_text(i).startswith("<") for i in ours.eos_ids)

