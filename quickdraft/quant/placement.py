"""Which form each weight takes in a runtime format, and what it costs: one rule, which the loader follows module by
module (weights/loader.py) and the memory plan counts before any weight is read (weights/memory.py)."""

from __future__ import annotations

import torch

from quickdraft.quant import QUANTIZED, for_source

FLOAT = "bf16"  # a weight kept in the model's dtype
# A checkpoint's projection -> the model's fused layer it goes into and its place there (q, k, v -> wqkv; gate, up ->
# w13): a step issues two matmuls fewer per layer
FUSED = {"wq": ("wqkv", 0), "wk": ("wqkv", 1), "wv": ("wqkv", 2), "w1": ("w13", 0), "w3": ("w13", 1)}


def parts(name: str) -> list[str]:
    """The checkpoint names a model tensor is made of: layers.3.attention.wqkv.weight -> its wq, wk and wv."""
    prefix, _, kind = name.rpartition(".")
    module, _, leaf = prefix.rpartition(".")
    got = [f"{module}.{p}.{kind}" for p, (target, _) in FUSED.items() if target == leaf]
    return got or [name]


def linear_kind(fmt: str, owner: str, source_types: dict) -> str:
    """The concrete format of the linear layer `owner` (its model name) under fmt: int8 or int4 (mixed follows the
    file's tensor types of its parts), FLOAT where fmt keeps float weights."""
    if fmt not in QUANTIZED:
        return FLOAT
    sources = [source_types[p] for p in parts(f"{owner}.weight") if p in source_types]
    return for_source(fmt, sources or [source_types.get(f"{owner}.weight")])


def linear_class(kind: str, n: int, k: int, device):
    """The layer class that holds an (n, k) weight of kind on device, None where it stays float (FLOAT, or a shape
    the kind's kernels refuse)."""
    from quickdraft.quant import int4, int8

    if kind == FLOAT:
        return None
    cls, supported = {"int4": (int4.Int4Linear, int4.supported), "int8": (int8.Int8Linear, int8.supported)}[kind]
    return cls if supported(torch.empty(n, k, device="meta"), torch.device(device)) else None


def layer(kind: str, weight, bias, device=None):
    """kind's linear layer (int8 or int4) for this weight (float rows, or an int4.Grid) on `device` (the CPU by
    default), or None where its kernels refuse the shape."""
    cls = linear_class(kind, *weight.shape, device or "cpu")
    return cls(weight, bias, device) if cls is not None else None


def linear_bytes(kind: str, n: int, k: int, device, dtype_size: int = 2) -> tuple[str, int]:
    """(the kind the layer really gets, its weight's bytes) for an (n, k) linear layer."""
    cls = linear_class(kind, n, k, device)
    return (kind, cls.nbytes_for(n, k, torch.device(device))) if cls is not None else (FLOAT, n * k * dtype_size)


def table_kind(fmt: str, source_type, dim: int) -> str:
    """How an embedding table is kept under fmt: "blocks" (a GGUF file's own block format, rows dequantized as looked
    up), int8 or int4 (quantized here in groups), or FLOAT."""
    from quickdraft.quant import embedding
    from quickdraft.quant.blocks import BLOCK_TYPES

    if fmt not in QUANTIZED:
        return FLOAT
    if source_type in BLOCK_TYPES:
        return "blocks"
    kind = for_source(fmt, [source_type])
    return kind if dim % embedding.quantized_width(kind) == 0 else FLOAT


def table_bytes(kind: str, rows: int, dim: int, file_bytes: int | None, dtype_size: int = 2) -> int:
    from quickdraft.quant import embedding

    if kind == "blocks":
        return file_bytes if file_bytes is not None else rows * dim
    if kind == FLOAT:
        return rows * dim * dtype_size
    return embedding.QuantEmbedding.nbytes_for(kind, rows, dim)
