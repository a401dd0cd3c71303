"""The real models against an independent implementation (HF transformers loading the same GGUF in fp32)."""

import math
from pathlib import Path

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams
from quickdraft.engine import Engine
from quickdraft.perplexity import perplexity
from quickdraft.quality import TEXT as QUALITY_TEXT
from quickdraft.weights.loader import load_model

pytestmark = pytest.mark.slow

TEXT = QUALITY_TEXT.read_text(encoding="utf-8")
CTX = 256
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "用一句话解释什么是机器学习。",
    "Summarize in one sentence: The printing press made copies of books cheap, so reading spread "
    "from monasteries to merchants and craftsmen, and ideas crossed borders faster than before.",
]


def hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_perplexity(model, tokens, ctx, bos_id):
    """llama.cpp's method, written independently of quickdraft.perplexity."""
    nll, count = 0.0, 0
    for c in range(len(tokens) // ctx):
        window = torch.tensor(tokens[c * ctx:(c + 1) * ctx])
        if bos_id is not None:
            window[0] = bos_id
        with torch.no_grad():
            logits = model(window[None]).logits[0].float()
        first = ctx // 2
        nll += torch.nn.functional.cross_entropy(logits[first:-1], window[first + 1:], reduction="sum").item()
        count += ctx - first - 1
    return math.exp(nll / count)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out, past = [], None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-1.5b", "gemma3-270m"])
def model_and_reference(request, real_model_path):
    path = real_model_path(request.param)
    return request.param, path, hf_from_gguf(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_perplexity_agrees_with_reference(model_and_reference, dtype):
    alias, path, reference = model_and_reference
    lm = load_model(str(path), EngineConfig(device="cpu", dtype=dtype, weights="bf16", max_context=CTX),
                    progress=False)  # the loader against the reference: no runtime quantization
    tokens = lm.tokenizer.encode(TEXT)  # with BOS where the model adds one: llama-perplexity's windows
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    ours = perplexity(lm.model, tokens, CTX, bos)
    want = hf_perplexity(reference, tokens, CTX, bos)
    print(f"{alias} {dtype}: ppl {ours.ppl:.4f} vs reference {want:.4f} over {ours.tokens} tokens")
    assert ours.chunks >= 3
    assert abs(ours.ppl / want - 1) < 0.01
    assert 1 < ours.ppl < 40  # a sensible English perplexity (the 270M base gives 30): a broken loader gives hundreds


def test_greedy_output_matches_reference(model_and_reference):
    alias, path, reference = model_and_reference
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32", max_context=512), progress=False)
    engine = Engine(lm)
    # the 1.5B in fp32 on two cores costs about 1 s a token on each side: two prompts (English, Chinese)
    prompts, n = (PROMPTS[:2], 24) if alias == "qwen2.5-coder-1.5b" else (PROMPTS, 32)
    for text in prompts:
        if lm.tokenizer.chat_template:
            text = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt = lm.tokenizer.encode(text)  # gemma3-270m is a base model: no template, the text as it is
        events = engine.generate(prompt, SamplingParams(max_tokens=n, stop_at_eos=False))
        ours = [e.token for e in events if e.token is not None]
        assert ours == hf_greedy(reference, prompt, n), lm.tokenizer.decode(ours)
