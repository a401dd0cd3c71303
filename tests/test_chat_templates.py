"""The chat templates of real models (the ones llama.cpp ships in models/templates/: Llama 3.x, Gemma 2/4, Mistral,
Phi-3.5, Qwen, DeepSeek, gpt-oss, ...) render through quickdraft exactly as through transformers' own renderer."""

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from quickdraft.tokenizer import Tokenizer
from tests import llamacpp

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello"}],
    "system and turns": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "Sum 2+2 — in «Ünïcode», \"quoted\" <b>tags</b>"}],
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TEMPLATES = sorted((llamacpp.tree() / "models" / "templates").glob("*.jinja"))


def test_there_are_templates_to_check():
    names = {t.name for t in TEMPLATES}
    assert len(names) >= 60
    assert {"meta-llama-Llama-3.1-8B-Instruct.jinja", "google-gemma-4-31B-it.jinja",
            "microsoft-Phi-3.5-mini-instruct.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja"} <= names


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_renders_as_transformers_renders_it(template, generation_prompt):
    source = template.read_text(encoding="utf-8")
    tokenizer = Tokenizer(backend=None, chat_template=source, special_tokens=SPECIAL)
    rendered = 0
    for messages in CONVERSATIONS.values():
        try:  # the reference first: some templates refuse a system turn, or need tools
            want = render_jinja_template([messages], chat_template=source, add_generation_prompt=generation_prompt,
                                         tools=None, **SPECIAL)[0][0]
        except Exception:
            continue
        assert tokenizer.apply_chat_template(messages, generation_prompt) == want
        rendered += 1
    if not rendered:
        pytest.skip("transformers renders none of the conversations with this template")
