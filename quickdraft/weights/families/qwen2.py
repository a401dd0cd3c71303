"""Qwen2 / Qwen2.5 (the default pair): biases on the q, k and v projections; rotary over whole heads, not permuted
in GGUF files."""

from quickdraft.weights.families.base import Family

FAMILY = Family("qwen2", hf_types=("qwen2",), hf_fields={"qkv_bias": True})
