"""Every family quickdraft runs, on tiny random models, against independent references: Hugging Face transformers'
own implementation (logits in float32, a full pass and one token at a time through the cache), and the same model
converted to GGUF by llama.cpp's own converter (quickdraft/tools/llamacpp.py). Then speculation: greedy output with a draft
equals plain output, in bf16 on the CPU kernels and in the quantized formats."""

from pathlib import Path

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights.loader import load_model
from tests import llamacpp
from tests.families import CONVERTED, FAMILIES, TOKENS, save, tiny_model
from tests.helpers import drafter

NOISE = 0.1  # the draft: the target with noise of this share of each parameter's spread added
FP32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)


def fp32(name: str) -> EngineConfig:
    """phi3's longrope takes its short factors within the original context (32): loaded with that context, as
    transformers uses them for a sequence that short (the long ones have a test of their own)."""
    return EngineConfig(**{**FP32.__dict__, "max_context": 32 if name == "phi3" else 256})


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(name)
    hf = tiny_model(name)
    save(hf, d / "hf")
    return name, hf, d


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def forward(lm, tokens, prefill=None):
    """Logits of a full pass, or of a prefill of `prefill` tokens then one token per step through the cache."""
    cache = KVCache.for_model(lm.model)
    with torch.no_grad():
        if prefill is None:
            return lm.model(torch.tensor([tokens]), cache)[0]
        out = [lm.model(torch.tensor([tokens[:prefill]]), cache)[0]]
        out += [lm.model(torch.tensor([[t]]), cache)[0] for t in tokens[prefill:]]
    return torch.cat(out)


def test_logits_equal_transformers_from_the_hugging_face_directory(family):
    name, hf, d = family
    ours = load_model(str(d / "hf"), fp32(name), progress=False)
    want = hf_logits(hf, TOKENS)
    torch.testing.assert_close(forward(ours, TOKENS), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(forward(ours, TOKENS, prefill=3), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # llama.cpp's converter in a process of its own for each file
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_logits_equal_transformers_from_llama_cpps_gguf(family, outtype):
    name, hf, d = family
    if name not in CONVERTED:
        pytest.skip(f"{name}: llama.cpp's GGUF of it is a different model (see CONVERTED)")
    gguf = llamacpp.convert(d / "hf", d / f"model-{outtype}.gguf", outtype)
    ours = load_model(str(gguf), fp32(name), progress=False)
    want = hf_logits(hf, TOKENS)
    if outtype == "f32":
        torch.testing.assert_close(forward(ours, TOKENS), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(forward(ours, TOKENS, prefill=3), want, rtol=1e-4, atol=1e-4)
    else:  # the weights rounded to Q8_0 blocks: close, mostly the same next tokens (a misread block would give
        # errors the size of the logits themselves, and next tokens at random)
        got = forward(ours, TOKENS)
        assert (got - want).abs().max() < 0.3 * want.abs().max()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.75


def test_longrope_switches_to_its_long_factors_beyond_the_original_context():
    """phi3 beyond original_max_position_embeddings (32): transformers uses the long factors for the whole sequence;
    quickdraft chooses by the context it loads with, once (a cached position never changes meaning)."""
    hf = tiny_model("phi3")
    tokens = (TOKENS * 3)[:40]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ours = load_model(str(save(hf, Path(tmp))), FP32, progress=False)  # context 256 > 32: the long factors
        torch.testing.assert_close(forward(ours, tokens), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights", ["bf16", "int8", "mixed"])
def test_greedy_speculation_equals_plain_in_every_family(family, weights):
    name, hf, d = family
    config = EngineConfig(device="cpu", dtype="bfloat16", weights=weights, max_context=256)
    target = load_model(str(d / "hf"), config, progress=False)
    noisy = tiny_model(name)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(NOISE * p.std() * torch.randn_like(p))
    draft = load_model(str(save(noisy, d / f"draft-{weights}")), config, progress=False)
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain = [e.token for e in Engine(target, 256).generate(TOKENS, params) if e.token is not None]
    for kind, spec in (("draft", SpeculationConfig(draft_max=4, adaptive=False)), ("combined", SpeculationConfig())):
        engine = Engine(target, 256, drafter(kind, target, draft), spec)
        events = list(engine.generate(TOKENS, params))
        assert [e.token for e in events if e.token is not None] == plain, (name, weights, kind)
        stats = events[-1].stats
        if kind == "draft":  # drafts kept (the commit) and drafts rejected (the rollback) both tested, but where
            # a tied head's greedy text settles into a loop the noisy draft gets right every time
            assert stats.draft_n_accepted > 0 and (stats.draft_n_accepted < stats.draft_n or len(set(plain[-20:])) < 4)
