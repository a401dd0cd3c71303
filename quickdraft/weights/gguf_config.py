"""A GGUF file's metadata -> ModelConfig: the keys every family shares, as llama.cpp's converter writes them and
llama.cpp reads them, checked against the tensors the file holds; then what the file's family adds
(weights/families/: its keys, and its defaults where llama.cpp hard-codes them), and a mixture of experts' keys."""

from __future__ import annotations

import re

from quickdraft.config import ModelConfig, RopeConfig
from quickdraft.errors import QuickdraftError
from quickdraft.weights import families
from quickdraft.weights.families.base import Gguf

# small tensors that are configuration, not weights: read into the config (weights/gguf.py reads them)
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def config(meta: dict, shapes: dict[str, tuple[int, ...]], small: dict[str, list[float]]) -> ModelConfig:
    """meta: the file's key/values; shapes: each tensor's shape (fastest dimension last); small: the values of the
    CONFIG_TENSORS present."""
    family = families.by_gguf(meta.get("general.architecture", "?"))
    g = Gguf(meta, shapes, small)
    arch = g.arch
    n_heads, dim, blocks = g.count("attention.head_count"), g.count("embedding_length"), g.count("block_count")
    present = {int(m.group(1)) for name in shapes if (m := re.match(r"blk\.(\d+)\.", name))}
    if present != set(range(blocks)):
        raise QuickdraftError(f"the GGUF metadata says {arch}.block_count = {blocks}, but the file holds tensors for "
                              f"{len(present)} layers: the file is inconsistent")
    mtp = int(g.get("nextn_predict_layers", 0) or 0)  # multi-token-prediction blocks after the decoder's
    layers = blocks - mtp
    if not 0 <= mtp < blocks:
        raise QuickdraftError(f"the GGUF metadata says {arch}.nextn_predict_layers = {mtp} of {blocks} blocks: the "
                              "file is inconsistent")
    embedding = shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2 or embedding[1] != dim:
        raise QuickdraftError(f"the GGUF metadata says {arch}.embedding_length = {dim}, but token_embd.weight has "
                              f"shape {embedding}: the file is inconsistent")
    head_dim = first(g.get("attention.key_length", dim // n_heads))
    kv_heads = g.get("attention.head_count_kv", n_heads)
    names = set(shapes)
    ffn = g.get("feed_forward_length", None) or g.get("expert_feed_forward_length", None)
    fields = dict(
        arch=family.name, vocab_size=embedding[0], dim=dim, n_layers=layers, n_heads=n_heads, n_kv_heads=first(kv_heads),
        head_dim=head_dim, ffn_dim=first(ffn if ffn is not None else g.get("feed_forward_length")),
        norm_eps=float(g.get("attention.layer_norm_rms_epsilon")), rope_theta=float(g.get("rope.freq_base", 10000.0)),
        max_context=g.get("context_length", 4096),
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm=any(f"blk.{i}.attn_q_norm.weight" in names for i in range(layers)),
        tie_embeddings="output.weight" not in names,
    )
    fields["rope"] = rope(g, fields["rope_theta"])
    fields.update(family.fields)
    fields.update(family.gguf(g, fields))
    if g.get("expert_count", None):
        fields.update(_experts(g, layers))
    return ModelConfig(**fields)


def first(value):
    """A per-layer array's first value (gemma4 writes some as arrays), or the value itself."""
    return value[0] if isinstance(value, list) else value


def rope(g: Gguf, theta: float, rotary: int | None = None) -> RopeConfig:
    """The rotary every family reads alike: plain or linearly scaled, with a rope_freqs tensor's per-frequency
    divisors (Llama 3's scaling, precomputed) where the file has one; rotary: the dimensions it rotates, where not
    the whole head."""
    scaling = g.get("rope.scaling.type", None) or "none"
    factors = tuple(g.small.get("rope_freqs.weight", ()))
    if scaling == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=float(g.get("rope.scaling.factor")),
                          rotary_dim=rotary, freq_factors=factors)
    if scaling != "none":
        raise QuickdraftError(f"this {g.arch} file uses RoPE scaling {scaling!r}, which quickdraft does not implement "
                              "(it does linear, llama3's rope_freqs and Phi-3's long/short factors)")
    return RopeConfig(theta=theta, rotary_dim=rotary, freq_factors=factors)


def _experts(g: Gguf, layers: int) -> dict:
    """The mixture of experts: expert_count experts, expert_used_count a token, each expert_feed_forward_length
    wide, their weights renormalised over the chosen ones (llama.cpp's qwen3moe and qwen35moe always do), a shared
    expert where expert_shared_feed_forward_length says; layers without ffn_gate_exps are dense."""
    return dict(n_experts=g.count("expert_count"), experts_per_token=g.count("expert_used_count"),
                expert_ffn_dim=g.count("expert_feed_forward_length"),
                norm_topk=bool(g.get("expert_weights_norm", True)),
                shared_expert_ffn_dim=int(g.get("expert_shared_feed_forward_length", 0)),
                dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in g.shapes))
