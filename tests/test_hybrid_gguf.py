"""Hybrids and mixtures of experts from GGUF files written by llama.cpp's own converter (quickdraft/tools/llamacpp.py) from tiny
random transformers models: qwen3.5 (its value heads reordered to llama.cpp's tiled order, -exp(A_log), the squeezed
convolution), qwen3.5 with its MTP block (llama.cpp's nextn tensors), qwen3.5's MoE (stacked experts, a shared
expert), qwen3 MoE. The config read from the file's metadata, logits against transformers, the MTP block equal to the
Hugging Face directory's, quantized files speculating exactly in every CPU format, the memory plan, and greedy tokens
equal to llama.cpp's own llama-server's on its own conversions (recorded: tests/reference_data.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.weights.loader import load_model
from tests import llamacpp
from tests.families import bpe_tokenizer
from tests.helpers import PROMPT, tokens_of as run
from tests.test_hybrid import tiny_qwen35, with_mtp
from tests.test_moe import tiny_moe

pytestmark = pytest.mark.slow  # llama.cpp's converter, six files

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
MODELS = ("qwen3_5", "qwen3_5-mtp", "qwen3_5_moe", "qwen3_moe")
QUANTIZED = ("qwen3_5-mtp", "qwen3_5_moe")  # also converted to q8_0


def build(name: str, directory: Path):
    """The transformers model and its directory, with a byte-level BPE tokenizer (what the converter reads)."""
    if name == "qwen3_5-mtp":
        model = tiny_qwen35(logit_scale=20)
        with_mtp(model, directory)
    else:
        # qwen3_moe without dense layers among the MoE ones: llama.cpp's qwen3moe has none
        model = tiny_qwen35(logit_scale=20) if name == "qwen3_5" else tiny_moe(name, logit_scale=20, dense=False)
        model.save_pretrained(directory)
    (directory / "tokenizer.json").unlink(missing_ok=True)
    bpe_tokenizer(directory)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (transformers model, its directory, {outtype: GGUF file})."""
    root = tmp_path_factory.mktemp("hybrid-gguf")
    out = {}
    for name in MODELS:
        hf_dir = root / name
        hf_dir.mkdir()
        model = build(name, hf_dir)
        flags = ("--no-mtp",) if name in ("qwen3_5", "qwen3_5_moe") else ()  # else it asks a qwen3.5 for MTP
        pre = "qwen35" if name.startswith("qwen3_5") else "qwen2"
        files = {t: llamacpp.convert(hf_dir, root / f"{name}-{t}.gguf", t, *flags, pre=pre)
                 for t in (("f32", "q8_0") if name in QUANTIZED else ("f32",))}
        out[name] = (model, hf_dir, files)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_the_config_read_from_the_files_metadata_is_the_directorys(converted, name):
    """Everything the model is built from, as config.json says it, but the order of the value heads, which the
    converter changed."""
    _, hf_dir, files = converted[name]
    from quickdraft.weights import gguf as gguf_io, safetensors as st_io

    reader = gguf_io.open_gguf(files["f32"])
    ours = gguf_io.config_from_metadata(gguf_io.metadata(reader), reader)
    want = st_io.read_config(hf_dir)
    hybrid = name.startswith("qwen3_5")
    assert ours.linear_v_tiled == hybrid
    assert abs(ours.norm_eps - want.norm_eps) < 1e-12  # stored as a float32
    assert dataclasses.replace(ours, linear_v_tiled=False, norm_eps=want.norm_eps) == want
    if hybrid:
        assert ours.linear_v_heads > ours.linear_k_heads  # the reorder is not the identity here


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(converted, name):
    """A prefill, steps through the cache and a verification-sized pass rolled back into its middle: every
    position's logits as transformers' one pass (float32)."""
    model, _, files = converted[name]
    ours = load_model(str(files["f32"]), F32, progress=False)
    tokens = torch.randint(0, 320, (1, 100), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = model(tokens).logits[0]
        cache = KVCache.for_model(ours.model)
        got = [ours.model(tokens[:, :70], cache)[0]]
        got += [ours.model(tokens[:, i:i + 1], cache)[0] for i in range(70, 80)]
        verified = ours.model(tokens[:, 80:89], cache)[0]
        cache.rollback(84)
        got += [verified[:4], ours.model(tokens[:, 84:100], cache)[0]]
    err = float((torch.cat(got) - want).abs().max())
    print(f"{name}: max |logit difference| against transformers from llama.cpp's GGUF: {err:.2e}")
    assert err <= 1e-5 * max(1.0, float(want.abs().max()))


def test_the_mtp_block_from_the_file_is_the_directorys(converted):
    _, hf_dir, files = converted["qwen3_5-mtp"]
    theirs = load_model(str(hf_dir), F32, progress=False).model.mtp.state_dict()
    ours = load_model(str(files["f32"]), F32, progress=False).model.mtp.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mixed"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_a_q8_0_file_speculates_exactly_in_every_format(converted, name, fmt):
    """The converter's q8_0 file (the experts' stacked blocks split per expert as they are read) in each CPU
    format: greedy output with n-gram lookup, and with the MTP block where the file has one, equals plain."""
    from quickdraft.speculative.draft import Draft, DraftBuilder

    _, _, files = converted[name]
    config = EngineConfig(device="cpu", dtype="bfloat16", weights=fmt, max_context=256, weight_cache=False)
    target = load_model(str(files["q8_0"]), config, progress=False)
    if fmt in ("int8", "mixed"):
        assert type(target.model.layers[0].attention.in_qkv).__name__ == "Int8Linear"
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain_engine = Engine(target, 256)
    prompt = PROMPT + run(plain_engine, params)[0] + PROMPT  # repeats: n-gram lookup finds drafts
    plain, _ = run(plain_engine, params, prompt)
    spec = SpeculationConfig(draft_max=4, adaptive=False)
    drafters = {"ngram": NgramDrafter()}
    if target.model.mtp is not None:
        drafters["mtp"] = DraftBuilder(target, config, 256).drafter(Draft.parse("mtp"), spec)
    for kind, drafter in drafters.items():
        ours, final = run(Engine(target, 256, drafter, spec), params, prompt)
        assert ours == plain, (name, fmt, kind)
        assert final.stats.draft_n > 0


@pytest.mark.parametrize("fmt", ["bf16", "int8", "mixed"])
def test_the_plan_counts_what_the_load_allocates(converted, fmt):
    """The memory plan of a MoE hybrid's file (its experts a share each of their stacked tensor) equals the
    loaded model's parameters and buffers."""
    from quickdraft.weights import memory

    path = str(converted["qwen3_5_moe"][2]["q8_0"])
    spec = memory.spec_from_source("target", path, fmt)
    planned, _ = memory.weight_bytes(spec.cfg, fmt, torch.device("cpu"), spec.types, spec.file_bytes)
    lm = load_model(path, EngineConfig(device="cpu", dtype="bfloat16", weights=fmt, max_context=64,
                                       weight_cache=False), progress=False)
    loaded = sum(t.numel() * t.element_size() for n, t in [*lm.model.named_parameters(), *lm.model.named_buffers()]
                 if not n.startswith("rope_"))
    assert planned == loaded, (planned, loaded)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_llama_servers(name):
    """llama.cpp's own llama-server on llama.cpp's own f32 conversion of each tiny model: its greedy continuation of
    token ids equals quickdraft's, plain and speculative. Recorded with the files it read (tests/reference/: building
    llama-server takes ten minutes; `python -m tests.reference_data llama-server` records them again)."""
    from tests.reference_data import hybrid_file, load

    recorded = load("llama-server")
    target = load_model(str(hybrid_file(name)), F32, progress=False)
    params = SamplingParams(max_tokens=recorded["n"], stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params, recorded["prompt"])
    spec, _ = run(Engine(target, 256, NgramDrafter(), SpeculationConfig()), params, recorded["prompt"])
    print(f"{name}: llama-server {recorded['tokens'][name]}\n{'':>{len(name)}}  quickdraft   {plain}")
    assert plain == recorded["tokens"][name] and spec == recorded["tokens"][name]
