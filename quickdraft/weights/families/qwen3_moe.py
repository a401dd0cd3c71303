"""Qwen3 MoE: Qwen3's attention; the FFN of most layers routes each token to experts (a GGUF file's expert keys are
shared by every family: weights/gguf_config.py). config.json: a routed layer every decoder_sparse_step outside
mlp_only_layers, renormalised where norm_topk_prob."""

from quickdraft.weights.families.base import Family


def _hf(d: dict, fields: dict) -> dict:
    n_layers = fields["n_layers"]
    step, dense = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or [])
    return dict(n_experts=d.get("num_experts") or d["num_local_experts"], experts_per_token=d["num_experts_per_tok"],
                expert_ffn_dim=d["moe_intermediate_size"], norm_topk=bool(d.get("norm_topk_prob", False)),
                dense_layers=tuple(i for i in range(n_layers) if i in dense or (i + 1) % step))


FAMILY = Family("qwen3_moe", gguf_arch="qwen3moe", hf_types=("qwen3_moe",), hf_fields={"qk_norm": True}, hf=_hf)
