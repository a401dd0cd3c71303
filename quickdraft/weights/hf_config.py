"""A Hugging Face config.json -> ModelConfig, for each family quickdraft runs, as transformers reads them (its 5.x
`rope_parameters` as well as the older `rope_theta` / `rope_scaling` keys; a multimodal checkpoint's text_config)."""

from __future__ import annotations

import math

from quickdraft.config import HYBRID_ARCHS, SUPPORTED_ARCHS, ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.config import RopeConfig

# config.json model_type -> quickdraft's family
ARCHS = {"llama": "llama", "mistral": "mistral", "ministral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
         "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "gemma4_text": "gemma4",
         "gemma4": "gemma4", "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_moe": "qwen3_moe",
         "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_moe": "qwen3_5_moe"}
GEMMAS = ("gemma2", "gemma3", "gemma4")


def model_config(d: dict) -> ModelConfig:
    model_type = d.get("model_type", "?")
    if model_type == "gemma4_assistant":
        return _assistant(d)
    if model_type in ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe") and isinstance(d.get("text_config"), dict):
        tie = {"tie_word_embeddings": d["tie_word_embeddings"]} if "tie_word_embeddings" in d else {}
        d = {**tie, **d["text_config"], "model_type": model_type + "_text"}  # the wrapper's tie unless the text says
    arch = ARCHS.get(model_type)
    if arch is None:
        raise QuickdraftError(f"unsupported architecture {model_type!r} in config.json: quickdraft runs "
                              f"{', '.join(SUPPORTED_ARCHS)} ({', '.join(sorted(ARCHS))} as config.json names them)")
    try:
        return _build(arch, d)
    except KeyError as e:
        raise QuickdraftError(f"config.json lacks {e.args[0]!r}, which a {model_type} model needs") from None


def _build(arch: str, d: dict) -> ModelConfig:
    n_heads, dim = d["num_attention_heads"], d["hidden_size"]
    head_dim = d.get("head_dim") or dim // n_heads
    n_layers = d["num_hidden_layers"]
    gemma = arch in GEMMAS
    layer_types = _layer_types(arch, d, n_layers)
    rope, rope_local = _ropes(arch, d, head_dim)
    fields = dict(
        arch=arch, vocab_size=d["vocab_size"], dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=d.get("num_key_value_heads") or n_heads, head_dim=head_dim,
        ffn_dim=d.get("intermediate_size") or d["moe_intermediate_size"],
        norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=rope.theta, max_context=d.get("max_position_embeddings", 4096),
        qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma4"),
        tie_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        rope=rope, rope_local=rope_local, layer_types=layer_types,
        sliding_window=d.get("sliding_window") if layer_types and "sliding" in layer_types else None,
    )
    if gemma:
        fields.update(activation="gelu_tanh", embed_scale=math.sqrt(dim), sandwich_norms=True,
                      final_softcap=d.get("final_logit_softcapping"))
    if arch in ("gemma2", "gemma3"):
        fields.update(attn_scale=d.get("query_pre_attn_scalar", 256) ** -0.5,
                      attn_softcap=d.get("attn_logit_softcapping") if arch == "gemma2" else None)
    if arch == "gemma4":
        fields.update(_gemma4(d, n_layers))
    if arch in ("qwen3_moe", "qwen3_5_moe"):
        fields.update(_experts(arch, d, n_layers))
    if arch in HYBRID_ARCHS:
        fields.update(attn_output_gate=bool(d.get("attn_output_gate", True)),
                      linear_k_heads=d["linear_num_key_heads"], linear_v_heads=d["linear_num_value_heads"],
                      linear_k_dim=d["linear_key_head_dim"], linear_v_dim=d["linear_value_head_dim"],
                      linear_conv=d.get("linear_conv_kernel_dim", 4), mtp_layers=int(d.get("mtp_num_hidden_layers") or 0))
    return ModelConfig(**fields)


def _layer_types(arch: str, d: dict, n_layers: int) -> tuple[str, ...] | None:
    """Each layer's attention, "full", "sliding" or "linear", as transformers decides it for the family."""
    kinds = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
    given = d.get("layer_types")
    if given:
        unknown = sorted(set(given) - set(kinds))
        if unknown:
            raise QuickdraftError(f"config.json has layer types {unknown}: quickdraft runs full_attention and "
                                  "sliding_attention")
        types = [kinds[t] for t in given]
        if arch == "gemma4":
            types[-1] = "full"  # as transformers forces it
        if "sliding" in types and not d.get("sliding_window"):
            raise QuickdraftError("config.json has sliding_attention layers but no sliding_window")
        return tuple(types) if {"sliding", "linear"} & set(types) else None
    if arch == "mistral":
        return ("sliding",) * n_layers if d.get("sliding_window") else None
    if arch == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    if arch in ("gemma3", "gemma4"):
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = ["sliding" if (i + 1) % pattern else "full" for i in range(n_layers)]
        if arch == "gemma4":
            types[-1] = "full"
        return tuple(types)
    if arch in HYBRID_ARCHS:  # transformers' default: every fourth layer full attention
        interval = d.get("full_attention_interval", 4)
        return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n_layers))
    if arch == "phi3" and d.get("sliding_window"):
        return ("sliding",) * n_layers
    return None


def rope_of(d: dict, head_dim: int) -> RopeConfig:
    """The rotary a config.json describes for all of its layers (a drafter's: weights/dflash.py)."""
    return _ropes("qwen3", d, head_dim)[0]


def _ropes(arch: str, d: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """The full layers' rotary and the sliding layers' (None where they are the same)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (gemma3, gemma4 in transformers 5)
        full = _rope(params["full_attention"], d, head_dim)
        local = params.get("sliding_attention")
        return full, _rope(local, d, head_dim) if local else None
    flat = dict(params or {})
    if not flat:  # transformers 4.x keys
        flat = dict(d.get("rope_scaling") or {})
        flat["rope_theta"] = d.get("rope_theta", 10000.0)
    if arch in HYBRID_ARCHS and "partial_rotary_factor" not in flat and "partial_rotary_factor" not in d:
        flat["partial_rotary_factor"] = 0.25  # transformers' default for qwen3.5
    full = _rope(flat, d, head_dim)
    if arch == "gemma3" and d.get("rope_local_base_freq"):
        return full, RopeConfig(theta=float(d["rope_local_base_freq"]))
    if arch == "gemma3" and not params:
        return full, RopeConfig(theta=10000.0)
    return full, None


def _rope(p: dict, d: dict, head_dim: int) -> RopeConfig:
    kind = p.get("rope_type", p.get("type")) or "default"
    theta = float(p.get("rope_theta", d.get("rope_theta", 10000.0)))
    partial = p.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
    rotary = int(head_dim * partial) if partial != 1.0 and kind != "proportional" else None
    original = d.get("original_max_position_embeddings") or p.get("original_max_position_embeddings") or 8192
    if kind == "default":
        return RopeConfig(theta=theta, rotary_dim=rotary)
    if kind == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=float(p["factor"]), rotary_dim=rotary)
    if kind == "llama3":
        return RopeConfig(theta=theta, scaling="llama3", factor=float(p["factor"]),
                          low_freq_factor=float(p.get("low_freq_factor", 1.0)),
                          high_freq_factor=float(p.get("high_freq_factor", 4.0)), original_context=int(original),
                          rotary_dim=rotary)
    if kind in ("longrope", "su"):
        factor = p.get("factor") or d.get("max_position_embeddings", original) / original
        attention = p.get("attention_factor") or (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
        return RopeConfig(theta=theta, scaling="longrope", original_context=int(original), rotary_dim=rotary,
                          short_factors=tuple(p["short_factor"]), long_factors=tuple(p["long_factor"]),
                          attention_factor=float(attention))
    if kind == "proportional":
        return RopeConfig(theta=theta, scaling="proportional", fraction=float(partial))
    raise QuickdraftError(f"unsupported rope scaling {kind!r} in config.json: quickdraft implements default, linear, "
                          "llama3, longrope and proportional")


def _gemma4(d: dict, n_layers: int) -> dict:
    """Gemma 4's extras: wider heads on full layers, values from the keys, shared KV, per-layer embeddings."""
    overrides = d.get("per_layer_config") or {}
    full = {}  # transformers 5 writes per-layer overrides; hub configs carry global_head_dim and friends
    for spec in overrides.values():
        full.update(spec or {})
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    head_dim_full = full.get("head_dim") or d.get("global_head_dim")
    kv_full = full.get("num_key_value_heads") or (d.get("num_global_key_value_heads") if k_eq_v else None)
    shared = int(d.get("num_kv_shared_layers") or 0)
    return dict(attn_scale=1.0, v_norm=True, k_eq_v=k_eq_v, head_dim_full=head_dim_full, n_kv_heads_full=kv_full,
                kv_shared_layers=shared,
                ffn_dim_shared=2 * d["intermediate_size"] if d.get("use_double_wide_mlp") and shared else None,
                ple_dim=int(d.get("hidden_size_per_layer_input") or 0),
                ple_vocab=int(d.get("vocab_size_per_layer_input") or d["vocab_size"]), layer_scalar=True)


def _experts(arch: str, d: dict, n_layers: int) -> dict:
    """The mixture of experts: qwen3_moe routes on layers outside mlp_only_layers every decoder_sparse_step, with
    norm_topk_prob; qwen3_5_moe on every layer, renormalised, with a shared expert."""
    if arch == "qwen3_5_moe":
        return dict(n_experts=d.get("num_experts") or d["num_local_experts"], experts_per_token=d["num_experts_per_tok"],
                    expert_ffn_dim=d["moe_intermediate_size"], norm_topk=True,
                    shared_expert_ffn_dim=d.get("shared_expert_intermediate_size") or 0)
    step, dense = d.get("decoder_sparse_step", 1) or 1, set(d.get("mlp_only_layers") or [])
    return dict(n_experts=d.get("num_experts") or d["num_local_experts"], experts_per_token=d["num_experts_per_tok"],
                expert_ffn_dim=d["moe_intermediate_size"], norm_topk=bool(d.get("norm_topk_prob", False)),
                dense_layers=tuple(i for i in range(n_layers) if i in dense or (i + 1) % step))


def _assistant(d: dict) -> ModelConfig:
    """Gemma 4's assistant (transformers' Gemma4AssistantConfig): its text model's config, every layer reading the
    target's keys and values (transformers marks them all KV-shared), with the widths of its projections and head."""
    text = d.get("text_config")
    if not isinstance(text, dict) or "backbone_hidden_size" not in d:
        raise QuickdraftError("config.json of a gemma4_assistant lacks text_config or backbone_hidden_size")
    if text.get("hidden_size_per_layer_input") or text.get("enable_moe_block"):
        raise QuickdraftError("this gemma4_assistant has per-layer inputs or a MoE block, which transformers' "
                              "assistant does not have either: the config is not an assistant's")
    cfg = model_config({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0, "use_double_wide_mlp": False})
    ordered = bool(d.get("use_ordered_embeddings", False))
    centroids, top_k = int(d.get("num_centroids", 2048)), int(d.get("centroid_intermediate_top_k", 32))
    if ordered and (cfg.vocab_size % centroids or not 0 < top_k <= centroids):
        raise QuickdraftError(f"config.json: {cfg.vocab_size} tokens in {centroids} centroids, {top_k} of them "
                              "chosen: the vocabulary must split evenly and the choice be at most all")
    return cfg.replace(assistant_backbone=int(d["backbone_hidden_size"]), centroids=centroids if ordered else 0,
                       centroid_top_k=top_k if ordered else 0, tie_embeddings=True)
