"""Runtime weight formats: weight-only int8 and int4 linear layers and embedding tables, converted once at load."""

from __future__ import annotations

FORMATS = ("auto", "bf16", "int8", "int4", "mixed")
QUANTIZED = ("int8", "int4", "mixed")


def resolve(fmt: str, device, dtype, role: str = "target") -> str:
    """The format `auto` stands for. With bf16 activations on CUDA, or on a CPU where quickdraft's VNNI kernels
    run: a target in `mixed` (int4 where the file holds 4-bit blocks, int8 elsewhere: the file's own quality at
    fewer bytes than int8; a float checkpoint gets int8 throughout), a draft in int4 (it decodes one token at a
    time: the fewest bytes win); bf16 everywhere else. docs/performance.md ("Weight formats") has the measurements
    behind these choices."""
    if fmt != "auto":
        return fmt
    import torch

    from quickdraft.quant import vnni

    kind = torch.device(device).type
    if kind not in ("cpu", "cuda") or dtype != torch.bfloat16:
        return "bf16"
    if role == "draft":
        return "int4"
    return "mixed" if kind == "cuda" or vnni.available() else "bf16"


def for_source(fmt: str, source_types) -> str:
    """The concrete format (int8 or int4) of a module whose weights the file holds in source_types (GGUF tensor
    types; None for a float checkpoint). `mixed` follows the file: int4 where every part is in 4-bit blocks (int4
    holds a Q4_0/Q4_1/Q4_K block's grid almost exactly, int8 per row does not), int8 where any part has more bits
    (Q5/Q6/Q8, float), which int4 would lose."""
    if fmt != "mixed":
        return fmt
    from quickdraft.quant.blocks import FOUR_BIT_TYPES

    types = list(source_types)
    return "int4" if types and all(t in FOUR_BIT_TYPES for t in types) else "int8"
