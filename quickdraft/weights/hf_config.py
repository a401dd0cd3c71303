"""A Hugging Face config.json -> ModelConfig: the keys every family shares, as transformers reads them (its 5.x
`rope_parameters` as well as the older `rope_theta` / `rope_scaling` keys; a multimodal checkpoint's text_config),
then what the config's family adds (weights/families/)."""

from __future__ import annotations

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.weights import families
from quickdraft.weights.families.base import hf_layer_types, hf_ropes


def model_config(d: dict) -> ModelConfig:
    model_type = d.get("model_type", "?")
    family, wrapper = families.by_hf(model_type)
    if model_type in family.hf_builders:
        return family.hf_builders[model_type](d)
    if wrapper and isinstance(d.get("text_config"), dict):
        tie = {"tie_word_embeddings": d["tie_word_embeddings"]} if "tie_word_embeddings" in d else {}
        d = {**tie, **d["text_config"], "model_type": model_type + "_text"}  # the wrapper's tie unless the text says
    try:
        return _build(family, d)
    except KeyError as e:
        raise QuickdraftError(f"config.json lacks {e.args[0]!r}, which a {model_type} model needs") from None


def _build(family, d: dict) -> ModelConfig:
    n_heads, dim = d["num_attention_heads"], d["hidden_size"]
    head_dim = d.get("head_dim") or dim // n_heads
    n_layers = d["num_hidden_layers"]
    types = hf_layer_types(d)
    if types is not None and "sliding" in types and not d.get("sliding_window"):
        raise QuickdraftError("config.json has sliding_attention layers but no sliding_window")
    rope, rope_local = hf_ropes(d, head_dim)
    fields = dict(
        arch=family.name, vocab_size=d["vocab_size"], dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        ffn_dim=d.get("intermediate_size") or d["moe_intermediate_size"],
        norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=rope.theta, max_context=d.get("max_position_embeddings", 4096),
        qkv_bias=bool(d.get("attention_bias", False)),
        tie_embeddings=bool(d.get("tie_word_embeddings", family.tied_by_default)),
        rope=rope, rope_local=rope_local,
        layer_types=tuple(types) if types is not None and {"sliding", "linear"} & set(types) else None,
    )
    fields.update(family.fields)
    fields.update(family.hf_fields)
    fields.update(family.hf(d, fields))
    kinds = fields["layer_types"]
    fields["sliding_window"] = d.get("sliding_window") if kinds and "sliding" in kinds else None
    return ModelConfig(**fields)
