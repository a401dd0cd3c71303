"""Qwen3 (dense): an RMSNorm on each head of q and k."""

from quickdraft.weights.families.base import Family

FAMILY = Family("qwen3", hf_types=("qwen3",), hf_fields={"qk_norm": True})
