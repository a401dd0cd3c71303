"""The real models against an independent implementation (HF transformers loading the same GGUF in fp32)."""

import math
import os
from pathlib import Path

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams
from quickdraft.engine import Batch, Engine
from quickdraft.perplexity import perplexity
from quickdraft.tools.quality import TEXT as QUALITY_TEXT
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


# The default draft stands for its family (qwen2) here: the default target (the 1.5B) is the same architecture, and
# its file's formats (Q4_K, Q6_K, F32) are among the 0.5B's (also Q5_0, Q8_0); the 1.5B in float32 cost 77 s of the
# suite's time (its load, perplexities and greedy tokens), and the real pair's tests run it throughout.
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
# transformers' answers on these files are recorded in tests/reference/transformers.json (tests/reference_data.py made
# them, and says with which versions): loading a model in float32 in transformers took more than a minute each run.
# QUICKDRAFT_CHECK_REFERENCES=1 runs transformers again and checks the record against it.
LIVE = os.environ.get("QUICKDRAFT_CHECK_REFERENCES") == "1"


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A test prompt as a chat turn (gemma3-270m is a base model without a template: the text as it is)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def recorded():
    from tests.reference_data import load

    return load("transformers")


@pytest.fixture(scope="module")
def fp32_models(real_model_path):
    """alias -> the real model in float32, its weights as the file has them (no runtime quantization: the loader
    against the reference); one at a time, the last kept until the module ends (the windows test's Gemma 3)."""
    loaded: dict = {}

    def get(alias: str):
        if alias not in loaded:
            loaded.clear()
            loaded[alias] = load_model(str(real_model_path(alias)), EngineConfig(
                device="cpu", dtype="float32", weights="bf16", max_context=512), progress=False)
        return loaded[alias]

    yield get
    loaded.clear()


@pytest.fixture(scope="module", params=MODELS)
def fp32(request, fp32_models):
    """Each real model in float32, loaded once for its perplexity and its greedy tokens."""
    return request.param, fp32_models(request.param)


def check_perplexity(recorded, alias, lm, dtype):
    tokens = lm.tokenizer.encode(TEXT)  # with BOS where the model adds one: llama-perplexity's windows
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    ours = perplexity(lm.model, tokens, CTX, bos)
    want = recorded["models"][alias]["ppl"]
    print(f"{alias} {dtype}: ppl {ours.ppl:.4f} vs transformers {want:.4f} ({recorded['transformers']}) over "
          f"{ours.tokens} tokens")
    assert ours.chunks >= 3
    assert abs(ours.ppl / want - 1) < 0.01
    assert 1 < ours.ppl < 60  # a sensible English perplexity (the 0.5B coder gives 41): a broken loader gives hundreds


def test_perplexity_agrees_with_reference(recorded, fp32):
    alias, lm = fp32
    check_perplexity(recorded, alias, lm, "float32")


@pytest.mark.parametrize("alias", MODELS)
def test_bfloat16_perplexity_agrees_with_reference(recorded, real_model_path, alias):
    lm = load_model(str(real_model_path(alias)), EngineConfig(device="cpu", dtype="bfloat16", weights="bf16",
                                                              max_context=CTX), progress=False)
    check_perplexity(recorded, alias, lm, "bfloat16")


def test_greedy_output_matches_reference(recorded, fp32):
    """The recorded prompts' greedy tokens, generated together (engine.Batch: the cases share each pass, a float32
    pass costing the same for their few rows as for one)."""
    alias, lm = fp32
    cases = recorded["models"][alias]["greedy"]
    engine = Engine(lm, slots=len(cases))
    requests = [dict(prompt=prompt_ids(lm.tokenizer, case["prompt"]),
                     params=SamplingParams(max_tokens=case["n"], stop_at_eos=False)) for case in cases]
    for case, events in zip(cases, Batch(engine).run(requests)):
        ours = [e.token for e in events if e.token is not None]
        assert ours == case["tokens"], lm.tokenizer.decode(ours)


@pytest.mark.skipif(not LIVE, reason="recorded (tests/reference/transformers.json); QUICKDRAFT_CHECK_REFERENCES=1 "
                                     "runs transformers again")
@pytest.mark.parametrize("alias", MODELS)
def test_the_record_is_what_transformers_answers(recorded, real_model_path, alias):
    from quickdraft.weights.loader import load_tokenizer

    path = real_model_path(alias)
    tokenizer, model = load_tokenizer(alias), hf_from_gguf(path)
    tokens = tokenizer.encode(TEXT)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    entry = recorded["models"][alias]
    assert abs(hf_perplexity(model, tokens, CTX, bos) / entry["ppl"] - 1) < 1e-4
    for case in entry["greedy"]:
        assert hf_greedy(model, prompt_ids(tokenizer, case["prompt"]), case["n"]) == case["tokens"]


def test_perplexity_uses_llama_perplexitys_windows(fp32_models):
    """llama-perplexity (recorded: tests/reference/llama-perplexity.json) on the real Gemma 3 270M and a short text:
    the same windows (the text tokenized with BOS, then cut) give the same perplexity up to the two engines'
    arithmetic (llama.cpp multiplies Q4_K weights by 8-bit activations; here float32). Windows one token off, as
    they once were, read 13% lower."""
    from tests.reference_data import load, perplexity_text

    recorded = load("llama-perplexity")
    lm = fp32_models(recorded["model"])  # the float32 load the other tests read (its 512 positions hold the windows)
    assert lm.model.max_context >= recorded["ctx"]
    tokens = lm.tokenizer.encode(perplexity_text())
    ours = perplexity(lm.model, tokens, recorded["ctx"], lm.tokenizer.bos_id if lm.tokenizer.add_bos else None)
    print(f"perplexity {ours.ppl:.3f}, llama-perplexity {recorded['ppl']:.3f} ({recorded['llama.cpp'][:7]})")
    assert abs(ours.ppl / recorded["ppl"] - 1) < 0.03
