"""GGUF files (read with the `gguf` package) -> ModelConfig, model-named tensors, tokenizer metadata."""

from __future__ import annotations

import mmap

from pathlib import Path

import torch
from gguf import GGUFReader

from quickdraft.config import SUPPORTED_ARCHS, ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.weights.dequant import SUPPORTED_TYPES, dequantize
from quickdraft.weights.names import gguf_to_model, unpermute_rotary


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors on anything not GGUF
        raise QuickdraftError(f"{path} is not a readable GGUF file ({e}); check the path or re-download it") from e


def metadata(reader: GGUFReader) -> dict:
    """All key/value metadata as plain Python values."""
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def drop_metadata(reader: GGUFReader) -> None:
    """Free the reader's parsed key/value fields (the tensors stay readable): the gguf library keeps every
    element of the vocabulary and merges arrays as numpy objects, hundreds of MB for a large vocabulary."""
    fields = getattr(reader, "fields", None)
    if hasattr(fields, "clear"):
        fields.clear()


def config_from_metadata(meta: dict, tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture", "?")
    if arch not in SUPPORTED_ARCHS:
        raise QuickdraftError(
            f"unsupported architecture {arch!r} in the GGUF file: quickdraft runs {', '.join(SUPPORTED_ARCHS)}"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise QuickdraftError(
            f"this {arch} model uses RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}), "
            "which quickdraft does not implement yet"
        )

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise QuickdraftError(f"the GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        dim=dim,
        n_layers=get("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", dim // n_heads),
        ffn_dim=get("feed_forward_length"),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_context=get("context_length", 4096),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
    )


def check_tensor_types(reader: GGUFReader) -> None:
    """Fail before the long part of a load if any tensor is in a format we cannot read."""
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(x.name for x in SUPPORTED_TYPES)
            raise QuickdraftError(
                f"tensor {t.name} has type {t.tensor_type.name}, which quickdraft does not read "
                f"(supported: {names}); use a file quantized to one of these, e.g. Q4_K_M or Q8_0"
            )


def read_tensors(reader: GGUFReader, cfg: ModelConfig, dtype: torch.dtype, progress=None, lazy: bool = False,
                 types: dict | None = None):
    """Dequantize every tensor the model uses into `dtype`, one at a time: yields (model name, tensor).
    types: filled with each model name's GGUF tensor type as it is read.

    lazy: the vocabulary-sized tables come as FileRows, dequantized by the consumer a block of rows at a time
    (for a loader that quantizes them: they are never in full precision in full).
    `progress(nbytes)` is called after each tensor with the bytes it covered.
    """
    for t in reader.tensors:
        name = gguf_to_model(t.name)
        if name is not None:
            if types is not None:
                types[name] = t.tensor_type
            shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dimension first
            if lazy and name in FileRows.NAMES:
                w = FileRows(t.data, t.tensor_type, shape, dtype)
            else:
                w = dequantize(t.data, t.tensor_type, shape, dtype)
                if cfg.arch == "llama" and name.endswith(("attention.wq.weight", "attention.wk.weight")):
                    heads = cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads
                    w = unpermute_rotary(w, heads)
            yield name, w
        _release(reader, t)
        if progress is not None:
            progress(int(t.n_bytes))


class FileRows:
    """A 2-D tensor still in the file that slicing rows dequantizes: `rows[i:j]` is a (j - i, K) tensor.

    Used only while the consumer runs (before the reader moves on), by quantized layers that read their
    weight a block of rows at a time, and by embedding tables that keep the raw blocks."""

    NAMES = ("tok_embeddings.weight", "output.weight")
    device = torch.device("cpu")

    def __init__(self, raw, qtype, shape: tuple[int, int], dtype: torch.dtype):
        self.raw, self.qtype, self.shape, self.dtype = raw, qtype, torch.Size(shape), dtype

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "FileRows slices whole blocks of rows"
        return dequantize(self.raw[start:stop], self.qtype, (stop - start, self.shape[1]), self.dtype)

    def full(self) -> torch.Tensor:
        return self[:]


def _release(reader: GGUFReader, t) -> None:
    """Drop the file pages of a tensor already read from the process (the file stays mapped: they come back
    from disk if touched again), so that loading does not hold the whole file in memory on top of the model."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) - int(t.data_offset) % mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):  # advice only
        pass
