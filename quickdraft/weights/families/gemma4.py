"""Gemma 4 (dense text), and its assistant drafter (gemma4_assistant): Gemma's layers with q/k norms and a weightless
norm on the values, wider heads with values taken from the keys on full layers, proportional rotary there, the last
layers sharing the keys and values of earlier ones (with a double-wide FFN), per-layer input embeddings, a learned
scalar per layer; the last layer always full."""

from quickdraft.config import RopeConfig
from quickdraft.errors import QuickdraftError
from quickdraft.weights.families.base import Family, hf_layer_types, windows
from quickdraft.weights.families.gemma2 import NAMES, gemma


def _gguf(g, fields: dict) -> dict:
    out = dict(**gemma(fields["dim"], g.get("final_logit_softcapping", None)), **windows(g, fields["n_layers"]))
    kv_heads = g.get("attention.head_count_kv", fields["n_heads"])
    kinds = out.get("layer_types") or ("full",) * fields["n_layers"]
    full = next((i for i, k in enumerate(kinds) if k == "full"), None)
    head_full = g.get("attention.key_length")
    head_swa = g.get("attention.key_length_swa", head_full)
    kv_full = kv_heads[full] if isinstance(kv_heads, list) and full is not None else None
    kv_swa = next((kv_heads[i] for i, k in enumerate(kinds) if k == "sliding"), kv_full) if isinstance(kv_heads, list) \
        else kv_heads
    ple = int(g.get("embedding_length_per_layer_input", 0) or 0)
    ffn = g.get("feed_forward_length")
    shared = int(g.get("attention.shared_kv_layers", 0) or 0)
    rope_full, masks = RopeConfig(theta=fields["rope_theta"]), g.small.get("rope_freqs.weight")
    if masks is not None:  # its rope_freqs: 1 where a frequency rotates, 1e30 where it does not (proportional rope)
        keep = sum(1 for f in masks if f < 1e10)
        rope_full = RopeConfig(theta=rope_full.theta, scaling="proportional", fraction=keep / len(masks))
    k_eq_v = full is not None and f"blk.{full}.attn_k.weight" in g.shapes and f"blk.{full}.attn_v.weight" not in g.shapes
    return dict(
        out, head_dim=head_swa, head_dim_full=head_full if head_full != head_swa else None, n_kv_heads=kv_swa,
        n_kv_heads_full=kv_full if kv_full not in (None, kv_swa) else None, attn_scale=1.0, v_norm=True, k_eq_v=k_eq_v,
        kv_shared_layers=shared, ffn_dim=ffn[0] if isinstance(ffn, list) else ffn,
        ffn_dim_shared=ffn[-1] if isinstance(ffn, list) and ffn[-1] != ffn[0] else None,
        ple_dim=ple, ple_vocab=g.shapes["per_layer_token_embd.weight"][0] if ple else 0, layer_scalar=True,
        rope=rope_full, rope_local=RopeConfig(theta=float(g.get("rope.freq_base_swa", 10000.0))),
    )


def _hf(d: dict, fields: dict) -> dict:
    types = hf_layer_types(d)
    if types is None:
        every = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = ["sliding" if (i + 1) % every else "full" for i in range(fields["n_layers"])]
    types[-1] = "full"  # as transformers forces it
    overrides = d.get("per_layer_config") or {}
    full = {}  # transformers 5 writes per-layer overrides; hub configs carry global_head_dim and friends
    for spec in overrides.values():
        full.update(spec or {})
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    kv_full = full.get("num_key_value_heads") or (d.get("num_global_key_value_heads") if k_eq_v else None)
    shared = int(d.get("num_kv_shared_layers") or 0)
    return dict(**gemma(fields["dim"], d.get("final_logit_softcapping")),
                layer_types=tuple(types) if {"sliding", "linear"} & set(types) else None,
                attn_scale=1.0, v_norm=True, k_eq_v=k_eq_v,
                head_dim_full=full.get("head_dim") or d.get("global_head_dim"), n_kv_heads_full=kv_full,
                kv_shared_layers=shared,
                ffn_dim_shared=2 * d["intermediate_size"] if d.get("use_double_wide_mlp") and shared else None,
                ple_dim=int(d.get("hidden_size_per_layer_input") or 0),
                ple_vocab=int(d.get("vocab_size_per_layer_input") or d["vocab_size"]), layer_scalar=True)


def assistant(d: dict):
    """Gemma 4's assistant (transformers' Gemma4AssistantConfig): its text model's config, every layer reading the
    target's keys and values (transformers marks them all KV-shared), with the widths of its projections and head."""
    from quickdraft.weights.hf_config import model_config

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


FAMILY = Family("gemma4", hf_types=("gemma4_text",), hf_wrappers=("gemma4",), gguf=_gguf, hf=_hf,
                hf_fields={"qk_norm": True}, tied_by_default=True, hf_names=NAMES,
                hf_builders={"gemma4_assistant": assistant})
