"""Qwen3.5 MoE hybrids: Qwen3.5's layers (qwen3_5.py) with every FFN a mixture of experts, renormalised over the chosen
ones, beside a shared expert gated by a sigmoid."""

from quickdraft.weights.families.base import Family
from quickdraft.weights.families.qwen3_5 import GGUF_NAMES, HF_NAMES, gguf_hybrid, hf_hybrid


def _hf(d: dict, fields: dict) -> dict:
    return dict(hf_hybrid(d, fields), n_experts=d.get("num_experts") or d["num_local_experts"],
                experts_per_token=d["num_experts_per_tok"], expert_ffn_dim=d["moe_intermediate_size"], norm_topk=True,
                shared_expert_ffn_dim=d.get("shared_expert_intermediate_size") or 0)


FAMILY = Family("qwen3_5_moe", gguf_arch="qwen35moe", hf_types=("qwen3_5_moe_text",), hf_wrappers=("qwen3_5_moe",),
                gguf=gguf_hybrid, hf=_hf, hf_fields={"qk_norm": True}, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
                hf_ignored=("model.visual.",), one_centred_norms=True)
