"""Phi-3, Phi-3.5, Phi-4: fused q/k/v and gate/up projections in the checkpoint (the GGUF file's ffn_up holds gate and
up), partial rotary, Phi-3's long/short rotary factors (longrope), sliding windows where the config sets them."""

from dataclasses import replace

from quickdraft.config import RopeConfig
from quickdraft.weights.families.base import Family, windows


def _gguf(g, fields: dict) -> dict:
    head_dim, theta = fields["head_dim"], fields["rope_theta"]
    dims = g.get("rope.dimension_count", None)
    rotary = dims if dims and dims != head_dim else None
    rope = fields["rope"]
    if "rope_factors_long.weight" in g.small:
        rope = RopeConfig(theta=theta, scaling="longrope", rotary_dim=rotary,
                          original_context=int(g.get("rope.scaling.original_context_length", 4096)),
                          short_factors=tuple(g.small["rope_factors_short.weight"]),
                          long_factors=tuple(g.small["rope_factors_long.weight"]),
                          attention_factor=float(g.get("rope.scaling.attn_factor", 1.0)))
    elif rotary is not None:
        rope = replace(rope, rotary_dim=rotary)
    return {"rope": rope, **windows(g, fields["n_layers"])}


def _hf(d: dict, fields: dict) -> dict:
    if not d.get("layer_types") and d.get("sliding_window"):
        return {"layer_types": ("sliding",) * fields["n_layers"]}
    return {}


FAMILY = Family("phi3", hf_types=("phi3",), gguf=_gguf, hf=_hf,
                gguf_names={"ffn_up.weight": "feed_forward.w13.weight"},
                hf_names={"self_attn.qkv_proj.weight": "attention.wqkv.weight",
                          "mlp.gate_up_proj.weight": "feed_forward.w13.weight"})
