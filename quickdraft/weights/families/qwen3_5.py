"""Qwen3.5 / 3.6 hybrids: Gated DeltaNet linear-attention layers (a recurrent state each) between gated full-attention
layers (q_proj also gives each head an output gate; q/k norms; partial rotary, a quarter of each head by default),
norms stored centred on 0 in config.json, multi-token-prediction layers where the checkpoint has them. llama.cpp
writes the linear layers' value heads tiled and -exp(A_log) for A_log. What the hybrids share is here (qwen3_5_moe.py
uses it)."""

from quickdraft.config import RopeConfig
from quickdraft.errors import QuickdraftError
from quickdraft.weights.families.base import Family, hf_ropes

# llama.cpp's names for a Gated DeltaNet layer (its full layers' are the shared ones); post_attention_norm is the norm
# before the FFN there, as in transformers' qwen3.5
GGUF_NAMES = {
    "attn_qkv.weight": "attention.in_qkv.weight",
    "attn_gate.weight": "attention.in_z.weight",
    "ssm_beta.weight": "attention.in_b.weight",
    "ssm_alpha.weight": "attention.in_a.weight",
    "ssm_conv1d.weight": "attention.conv_weight",
    "ssm_dt.bias": "attention.dt_bias",
    "ssm_a": "attention.A_log",  # the file holds -exp(A_log): weights/gguf.py takes the log back
    "ssm_norm.weight": "attention.out_norm.weight",
    "ssm_out.weight": "attention.wo.weight",
    "post_attention_norm.weight": "ffn_norm.weight",
}
HF_NAMES = {
    "linear_attn.in_proj_qkv.weight": "attention.in_qkv.weight",
    "linear_attn.in_proj_z.weight": "attention.in_z.weight",
    "linear_attn.in_proj_b.weight": "attention.in_b.weight",
    "linear_attn.in_proj_a.weight": "attention.in_a.weight",
    "linear_attn.conv1d.weight": "attention.conv_weight",
    "linear_attn.dt_bias": "attention.dt_bias",
    "linear_attn.A_log": "attention.A_log",
    "linear_attn.norm.weight": "attention.out_norm.weight",
    "linear_attn.out_proj.weight": "attention.wo.weight",
}


def gguf_hybrid(g, fields: dict) -> dict:
    """The Gated DeltaNet layers as llama.cpp's converter describes them: which layers are recurrent, the heads
    (ssm.group_count key heads of ssm.state_size, ssm.time_step_rank value heads, ssm.inner_size values in all), the
    convolution; its value heads in tiled order (the converter reorders them for ggml's broadcast); the full layers'
    output gate (their attn_q holds a gate per head too) and partial rotary."""
    layers = fields["n_layers"]
    recurrent = g.get("attention.recurrent_layers", None)
    if isinstance(recurrent, list):
        kinds = tuple("linear" if r else "full" for r in recurrent[:layers])
    else:
        interval = int(g.get("full_attention_interval", 4))
        kinds = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    v_heads = g.count("ssm.time_step_rank")
    inner = g.count("ssm.inner_size")
    if inner % v_heads:
        raise QuickdraftError(f"the GGUF metadata has {g.arch}.ssm.inner_size = {inner} for {v_heads} value heads "
                              "(ssm.time_step_rank): the file is inconsistent")
    full = next((i for i, k in enumerate(kinds) if k == "full"), None)
    q_rows = g.shapes.get(f"blk.{full}.attn_q.weight", (0,))[0] if full is not None else 0
    rope = fields["rope"]
    rotary = g.get("rope.dimension_count", None)
    if rotary and rotary != fields["head_dim"]:
        rope = RopeConfig(theta=rope.theta, rotary_dim=int(rotary))
    mtp = int(g.get("nextn_predict_layers", 0) or 0)
    return dict(layer_types=kinds, linear_k_heads=g.count("ssm.group_count"), linear_v_heads=v_heads,
                linear_k_dim=g.count("ssm.state_size"), linear_v_dim=inner // v_heads,
                linear_conv=g.count("ssm.conv_kernel"), linear_v_tiled=True,
                attn_output_gate=q_rows == 2 * fields["n_heads"] * fields["head_dim"], rope=rope, mtp_layers=mtp)


def hf_hybrid(d: dict, fields: dict) -> dict:
    out = dict(attn_output_gate=bool(d.get("attn_output_gate", True)),
               linear_k_heads=d["linear_num_key_heads"], linear_v_heads=d["linear_num_value_heads"],
               linear_k_dim=d["linear_key_head_dim"], linear_v_dim=d["linear_value_head_dim"],
               linear_conv=d.get("linear_conv_kernel_dim", 4), mtp_layers=int(d.get("mtp_num_hidden_layers") or 0),
               rope=hf_ropes(d, fields["head_dim"], partial=0.25)[0])  # transformers' default: a quarter rotates
    if not d.get("layer_types"):  # transformers' default: every fourth layer full attention
        interval = d.get("full_attention_interval", 4)
        out["layer_types"] = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(fields["n_layers"]))
    return out


FAMILY = Family("qwen3_5", gguf_arch="qwen35", hf_types=("qwen3_5_text",), hf_wrappers=("qwen3_5",), gguf=gguf_hybrid,
                hf=hf_hybrid, hf_fields={"qk_norm": True}, gguf_names=GGUF_NAMES, hf_names=HF_NAMES,
                hf_ignored=("model.visual.",), one_centred_norms=True)
