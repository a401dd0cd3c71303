"""Conversions kept on disk (weights/converted.py): a second load reads back exactly what the first converted,
and a changed model file, a changed format or a damaged file never gives a stale or broken model."""

import logging
import os

import pytest
import torch

from quickdraft.config import EngineConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights import converted
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_config, write_gguf_from_hf

CPU = EngineConfig(device="cpu", dtype="bfloat16", max_context=128)
TEXT = "t5 t17 t250 t3"


@pytest.fixture
def kept_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(converted, "MIN_BYTES", 0)  # keep even the tiny test models
    return tmp_path / "cache" / "converted"


def tiny(tie=False, seed=0):
    import transformers

    config = tiny_hf_config("qwen2")
    config.hidden_size, config.intermediate_size, config.tie_word_embeddings = 128, 256, tie
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def gguf_file(tmp_path, tie=False, seed=0, name="m.gguf"):
    from gguf import GGMLQuantizationType as T

    types = {"attn_q.weight": T.Q4_0, "attn_k.weight": T.Q4_0, "attn_v.weight": T.Q8_0,
             "attn_output.weight": T.Q4_0, "ffn_gate.weight": T.Q4_0, "ffn_up.weight": T.Q4_0,
             "ffn_down.weight": T.Q8_0}
    return write_gguf_from_hf(tiny(tie, seed), tmp_path / name, layer_types=types, table_type=T.Q8_0)


def logits(lm):
    with torch.no_grad():
        return lm.model(torch.tensor([[5, 17, 250, 3, 99, 42]]), KVCache.for_model(lm.model, 16))


def same_model(a, b):
    assert a.config == b.config and a.weights == b.weights
    assert [(n, type(m)) for n, m in a.model.named_modules()] == [(n, type(m)) for n, m in b.model.named_modules()]
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.testing.assert_close(logits(a), logits(b), rtol=0, atol=0)
    assert a.tokenizer.encode(TEXT) == b.tokenizer.encode(TEXT) and a.tokenizer.eos_ids == b.tokenizer.eos_ids
    assert (a.tokenizer.bos_id, a.tokenizer.chat_template) == (b.tokenizer.bos_id, b.tokenizer.chat_template)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fmt", ["mixed", "int4"])
def test_the_second_load_reads_back_exactly_the_first_conversion(tmp_path, kept_dir, fmt, tie):
    path = str(gguf_file(tmp_path, tie))
    config = EngineConfig(**{**CPU.__dict__, "weights": fmt})
    first = load_model(path, config, progress=False)
    files = list(kept_dir.iterdir())
    assert first.kept_from is None and len(files) == 1 and fmt in files[0].name
    second = load_model(path, config, progress=False)
    assert second.kept_from == files[0]
    same_model(first, second)
    assert second.model.max_context == 128  # the context is the load's, not the kept one's


def test_a_float_checkpoint_directory_is_kept_too(tmp_path, kept_dir):
    path = str(save_hf_dir(tiny(), tmp_path / "hf"))
    config = EngineConfig(**{**CPU.__dict__, "weights": "int8"})
    first, second = load_model(path, config, progress=False), load_model(path, config, progress=False)
    assert first.kept_from is None and second.kept_from is not None
    same_model(first, second)


def test_a_changed_file_or_format_converts_again_and_replaces_the_old_copy(tmp_path, kept_dir):
    path = gguf_file(tmp_path)
    int4 = EngineConfig(**{**CPU.__dict__, "weights": "int4"})
    first = load_model(str(path), int4, progress=False)
    (old,) = kept_dir.iterdir()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched, the same content
    assert load_model(str(path), int4, progress=False).kept_from == old
    # another file of the same size put in its place, with the same modification time: another source
    other = gguf_file(tmp_path, seed=1, name="other.gguf")
    assert other.stat().st_size == path.stat().st_size
    mtime = path.stat().st_mtime_ns
    os.replace(other, path)
    os.utime(path, ns=(mtime, mtime))
    again = load_model(str(path), int4, progress=False)
    (new,) = kept_dir.iterdir()  # the old copy is gone
    assert again.kept_from is None and new != old
    fresh = load_model(str(path), EngineConfig(**{**CPU.__dict__, "weights": "int4", "weight_cache": False}), False)
    torch.testing.assert_close(logits(again), logits(fresh), rtol=0, atol=0)  # the new file's model...
    assert not torch.equal(logits(again), logits(first))  # ...not the old one's
    other = load_model(str(path), EngineConfig(**{**CPU.__dict__, "weights": "int8"}), progress=False)
    assert other.kept_from is None and len(list(kept_dir.iterdir())) == 2  # one per format


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_copy_is_converted_again(tmp_path, kept_dir, caplog, damage):
    path = str(gguf_file(tmp_path))
    config = EngineConfig(**{**CPU.__dict__, "weights": "int4"})
    want = load_model(path, config, progress=False)
    (file,) = kept_dir.iterdir()
    data = bytearray(file.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # bytes inside a tensor's data: the file still loads, its values do not
        blob = torch.load(file, weights_only=True)
        packed = next(t for name, t in blob["state"].items() if name.endswith("packed"))
        at = bytes(data).find(packed.reshape(-1).view(torch.uint8)[:64].numpy().tobytes())
        assert at > 0
        data[at + 10] ^= 0xFF
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        got = load_model(path, config, progress=False)
    assert got.kept_from is None and "unreadable" in caplog.text
    same_model(want, got)
    assert load_model(path, config, progress=False).kept_from == file  # written again


def test_no_copy_without_the_cache_or_for_small_models(tmp_path, kept_dir, monkeypatch):
    path = str(gguf_file(tmp_path))
    load_model(path, EngineConfig(**{**CPU.__dict__, "weights": "int4", "weight_cache": False}), progress=False)
    load_model(path, EngineConfig(**{**CPU.__dict__, "weights": "bf16"}), progress=False)  # nothing to convert
    monkeypatch.setattr(converted, "MIN_BYTES", 32 * 2**20)
    load_model(path, EngineConfig(**{**CPU.__dict__, "weights": "int4"}), progress=False)
    assert not kept_dir.exists() or not any(kept_dir.iterdir())


def test_a_cache_that_cannot_be_written_only_costs_the_shortcut(tmp_path, kept_dir, caplog):
    kept_dir.parent.mkdir(parents=True)
    kept_dir.write_text("a file where the directory should be")
    path = str(gguf_file(tmp_path))
    config = EngineConfig(**{**CPU.__dict__, "weights": "int4"})
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        lm = load_model(path, config, progress=False)
    assert lm.kept_from is None and "could not keep the converted weights" in caplog.text
    assert load_model(path, config, progress=False).kept_from is None
