"""Checkpoint tensor names -> the model's own parameter names (those every family shares, then the family's own:
weights/families/), and the rotary row permutation.

The model (quickdraft.models.transformer) names its parameters
    tok_embeddings, layers.{i}.{attention_norm, attention.{wq,wk,wv,wo,q_norm,k_norm}, post_attention_norm,
    ffn_norm, feed_forward.{w1 (gate), w2 (down), w3 (up)}, post_ffn_norm, ple_gate, ple_proj, ple_norm,
    layer_scalar}, norm, output, ple_embeddings, ple_model_proj, ple_proj_norm
and fuses wq/wk/wv into attention.wqkv and w1/w3 into feed_forward.w13 at load time (`fused`), so that a step
issues two matmuls fewer per layer; phi3 checkpoints hold them fused already.

Families differ where a name means something else (in llama's checkpoints the norm after attention is the one before
the FFN, in gemma's it is the sandwich norm after attention; phi3's GGUF `ffn_up` is the fused gate and up
projection): each family's file says so (Family.gguf_names, hf_names).
"""

from __future__ import annotations

import re

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.quant.placement import FUSED
from quickdraft.weights import families

# GGUF (llama.cpp) names
_GGUF_LAYER = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_qkv.weight": "attention.wqkv.weight",
    "attn_output.weight": "attention.wo.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "post_attention_norm.weight": "post_attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "inp_gate.weight": "ple_gate.weight",
    "proj.weight": "ple_proj.weight",
    "post_norm.weight": "ple_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "per_layer_token_embd.weight": "ple_embeddings.weight",
    "per_layer_model_proj.weight": "ple_model_proj.weight",
    "per_layer_proj_norm.weight": "ple_proj_norm.weight",
}

# a mixture of experts in GGUF: the router, the shared expert and its gate; the routed experts' matrices are
# stacked in one tensor each (ffn_{gate,up,down}_exps: gguf_model_names lists an expert's name per slice)
_GGUF_MOE = {
    "ffn_gate_inp.weight": "feed_forward.router.weight",
    "ffn_gate_shexp.weight": "feed_forward.shared.w1.weight",
    "ffn_up_shexp.weight": "feed_forward.shared.w3.weight",
    "ffn_down_shexp.weight": "feed_forward.shared.w2.weight",
    "ffn_gate_inp_shexp.weight": "feed_forward.shared_gate.weight",
}
_GGUF_EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
# a multi-token-prediction block (llama.cpp: the block after the decoder's, with nextn.* tensors)
_GGUF_MTP = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.enorm.weight",
             "nextn.hnorm.weight": "mtp.hnorm.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}

# Hugging Face transformers names
_HF_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "per_layer_input_gate.weight": "ple_gate.weight",
    "per_layer_projection.weight": "ple_proj.weight",
    "post_per_layer_input_norm.weight": "ple_norm.weight",
    "layer_scalar": "layer_scalar",
}
_HF_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    # a Gemma 4 assistant's own parts (models/assistant.py)
    "pre_projection.weight": "pre_projection.weight",
    "post_projection.weight": "post_projection.weight",
    "masked_embedding.centroids.weight": "centroids.weight",
    "masked_embedding.token_ordering": "token_ordering",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "ple_embeddings.weight",
    "model.per_layer_model_projection.weight": "ple_model_proj.weight",
    "model.per_layer_projection_norm.weight": "ple_proj_norm.weight",
}

# a mixture of experts' parts: the router, experts.E.{gate,up,down}_proj, the shared expert and its gate
_HF_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.(?:(gate)\.weight|experts\.(\d+)\.(gate|up|down)_proj\.weight|"
                           r"shared_expert\.(gate|up|down)_proj\.weight|(shared_expert_gate)\.weight)")
_SWIGLU = {"gate": "w1", "up": "w3", "down": "w2"}


def _expert_name(m: re.Match) -> str:
    layer, router, expert, part, shared, shared_gate = m.groups()
    if router:
        leaf = "router.weight"
    elif expert is not None:
        leaf = f"experts.{expert}.{_SWIGLU[part]}.weight"
    elif shared is not None:
        leaf = f"shared.{_SWIGLU[shared]}.weight"
    else:
        leaf = "shared_gate.weight"
    return f"layers.{layer}.feed_forward.{leaf}"


_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")

# Tensors a checkpoint may carry that the model does not use as weights (rotary tables and factors: read into the
# config by the GGUF reader; transformers' inv_freq buffers).
_IGNORED = re.compile(r"(rope_freqs\.weight|rope_factors_(long|short)\.weight|.*rotary_emb\.inv_freq)$")


def _map(name: str, layer_re, layer_map, global_map) -> str | None:
    if name in global_map:
        return global_map[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def gguf_to_model(name: str, arch: str, n_layers: int | None = None) -> str | None:
    """GGUF tensor name -> model parameter name; None for tensors the model does not use. n_layers: the decoder's
    layers, where blocks after them are multi-token-prediction blocks (qwen3.5's nextn)."""
    if _IGNORED.match(name):
        return None
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and n_layers is not None and int(m.group(1)) >= n_layers:
        if int(m.group(1)) > n_layers:
            return _unknown(name)  # a second MTP block: llama.cpp and vLLM run one
        inner = _GGUF_MTP.get(m.group(2)) or gguf_to_model(f"blk.0.{m.group(2)}", arch)
        return inner if inner.startswith("mtp.") else "mtp.layer." + inner.removeprefix("layers.0.")
    layer = {**_GGUF_LAYER, **_GGUF_MOE, **families.get(arch).gguf_names}
    mapped = _map(name, _GGUF_LAYER_RE, layer, _GGUF_GLOBAL)
    return mapped if mapped is not None else _unknown(name)


def gguf_model_names(name: str, cfg) -> list[str]:
    """The model parameters a GGUF tensor holds: one, none (tensors the model does not use), or for a MoE layer's
    stacked experts (ffn_*_exps) each expert's matrix in order."""
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_EXPERTS:
        layer = int(m.group(1))
        if layer > cfg.n_layers:
            return _unknown(name)
        owner = "mtp.layer" if layer == cfg.n_layers else f"layers.{layer}"  # the MTP block's own experts
        return [f"{owner}.feed_forward.experts.{e}.{_GGUF_EXPERTS[m.group(2)]}.weight" for e in range(cfg.n_experts)]
    mapped = gguf_to_model(name, cfg.arch, cfg.n_layers)
    return [] if mapped is None else [mapped]


def hf_to_model(name: str, arch: str) -> str | None:
    """Hugging Face parameter name -> model parameter name; None for tensors the model does not use."""
    if _IGNORED.match(name):
        return None
    family = families.get(arch)
    name = name.replace("model.language_model.", "model.", 1)  # a multimodal checkpoint's text model
    if family.hf_ignored and name.startswith(family.hf_ignored):  # a part it does not run (a vision tower)
        return None
    if name.startswith(("mtp.", "model.mtp.")):  # qwen3.5's multi-token-prediction block: models/transformer.MTP
        return _mtp_name(name.removeprefix("model."), arch)
    expert = _HF_EXPERT_RE.fullmatch(name)
    if expert:
        return _expert_name(expert)
    mapped = _map(name, _HF_LAYER_RE, {**_HF_LAYER, **family.hf_names}, _HF_GLOBAL)
    return mapped if mapped is not None else _unknown(name)


_MTP_GLOBAL = {"mtp.fc.weight": "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight": "mtp.enorm.weight",
               "mtp.pre_fc_norm_hidden.weight": "mtp.hnorm.weight", "mtp.norm.weight": "mtp.norm.weight"}


def _mtp_name(name: str, arch: str) -> str | None:
    """mtp.fc / pre_fc_norm_* / norm, and mtp.layers.0.<a decoder layer's names> -> the MTP module's names."""
    if name in _MTP_GLOBAL:
        return _MTP_GLOBAL[name]
    inner = hf_to_model(name.replace("mtp.layers.", "model.layers.", 1), arch)
    if inner is None or not inner.startswith("layers.0."):
        return _unknown(name)  # a second MTP layer: llama.cpp and vLLM run one
    return "mtp.layer." + inner.removeprefix("layers.0.")


def _unknown(name: str):
    raise QuickdraftError(
        f"unexpected tensor {name!r} in the checkpoint: this model's architecture has parts "
        "quickdraft does not implement"
    )


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved rotary -> half-split rotary).

    The converter writes, per head, rows (0, h, 1, h+1, ...) of the Hugging Face layout, where h is half
    the head size, so that ggml's interleaved ("normal") RoPE applies. Our model, like Hugging Face and
    like qwen2 files, rotates the two halves of each head ("neox" RoPE), so the rows are put back.
    """
    rows = w.shape[0]
    head = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def fused(tensors, expected=lambda key: 3 if key.rpartition(".")[0].endswith("wqkv") else 2, cat=torch.cat):
    """Concatenate q/k/v (weights and biases) and gate/up row-wise as their parts arrive: yields (name, tensor)
    under the model's fused names, holding back only the parts of a group not yet complete. expected(fused name):
    how many parts that group has (a gemma4 layer may have only q, or q and k); cat: the row-wise concatenation
    (the loader's also takes matrices still in the file: weights/gguf.cat_rows)."""
    held: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in tensors:
        prefix, _, kind = name.rpartition(".")  # layers.3.attention.wq, weight
        module, _, leaf = prefix.rpartition(".")
        if leaf not in FUSED:
            yield name, w
            continue
        target, index = FUSED[leaf]
        key = f"{module}.{target}.{kind}"
        group = held.setdefault(key, {})
        group[index] = w
        if len(group) == expected(key):
            yield key, cat([group[i] for i in sorted(group)])
            del held[key]
    if held:
        raise QuickdraftError(f"the checkpoint lacks parts of fused projections: {sorted(held)[:3]}")
