"""Checkpoint tensor names -> the model's own parameter names, and the rotary row permutation.

The model (quickdraft.models.transformer) names its parameters
    tok_embeddings, layers.{i}.{attention_norm, attention.{wq,wk,wv,wo,q_norm,k_norm}, ffn_norm,
    feed_forward.{w1 (gate), w2 (down), w3 (up)}}, norm, output
and fuses wq/wk/wv into attention.wqkv and w1/w3 into feed_forward.w13 at load time
(`fuse_projections`), so that a step issues two matmuls fewer per layer.
"""

from __future__ import annotations

import re

import torch

from quickdraft.errors import QuickdraftError

# GGUF (llama.cpp) names
_GGUF_LAYER = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}

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
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
_HF_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}

_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")

# Tensors a checkpoint may carry that the model does not use (precomputed rotary tables).
_IGNORED = re.compile(r"(rope_freqs\.weight|.*rotary_emb\.inv_freq)$")


def _map(name: str, layer_re, layer_map, global_map) -> str | None:
    if name in global_map:
        return global_map[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def gguf_to_model(name: str) -> str | None:
    """GGUF tensor name -> model parameter name; None for tensors the model does not use."""
    if _IGNORED.match(name):
        return None
    mapped = _map(name, _GGUF_LAYER_RE, _GGUF_LAYER, _GGUF_GLOBAL)
    return mapped if mapped is not None else _unknown(name)


def hf_to_model(name: str) -> str | None:
    """Hugging Face parameter name -> model parameter name; None for tensors the model does not use."""
    if _IGNORED.match(name):
        return None
    mapped = _map(name, _HF_LAYER_RE, _HF_LAYER, _HF_GLOBAL)
    return mapped if mapped is not None else _unknown(name)


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


FUSED = {"wq": ("wqkv", 0), "wk": ("wqkv", 1), "wv": ("wqkv", 2), "w1": ("w13", 0), "w3": ("w13", 1)}


def parts(name: str) -> list[str]:
    """The checkpoint names a model tensor is made of: layers.3.attention.wqkv.weight -> its wq, wk and wv."""
    prefix, _, kind = name.rpartition(".")
    module, _, leaf = prefix.rpartition(".")
    got = [f"{module}.{p}.{kind}" for p, (target, _) in FUSED.items() if target == leaf]
    return got or [name]


def fused(tensors):
    """Concatenate q/k/v (weights and biases) and gate/up row-wise as their parts arrive: yields (name, tensor)
    under the model's fused names, holding back only the parts of a group not yet complete."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in tensors:
        prefix, _, kind = name.rpartition(".")  # layers.3.attention.wq, weight
        module, _, leaf = prefix.rpartition(".")
        if leaf not in FUSED:
            yield name, w
            continue
        target, index = FUSED[leaf]
        key = f"{module}.{target}.{kind}"
        group = parts.setdefault(key, {})
        group[index] = w
        if len(group) == (3 if target == "wqkv" else 2):
            yield key, torch.cat([group[i] for i in sorted(group)])
            del parts[key]
    if parts:
        raise QuickdraftError(f"the checkpoint lacks parts of fused projections: {sorted(parts)[:3]}")
