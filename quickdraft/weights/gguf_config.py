"""A GGUF file's metadata -> ModelConfig, for each family quickdraft runs, as llama.cpp's converter writes them and
llama.cpp reads them, checked against the tensors the file holds.

Where a file leaves something out that the family defines, the family's defaults are used, as llama.cpp hard-codes
them: gemma3's local:global layer pattern (5 sliding layers to 1 global, unless the file has
attention.sliding_window_pattern), its local rope base (10,000) and its attention scale (1 / sqrt(head size), but
1 / sqrt(dim / heads) for the 62-layer 27B); gemma2's alternating pattern and scale likewise.
"""

from __future__ import annotations

import math
import re

from quickdraft.config import HYBRID_ARCHS, SUPPORTED_ARCHS, ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.config import RopeConfig

GEMMAS = ("gemma2", "gemma3", "gemma4")
# small tensors that are configuration, not weights: read into the config (weights/gguf.py reads them)
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


# llama.cpp's architecture names where they are not quickdraft's
GGUF_ARCHS = {"qwen3moe": "qwen3_moe", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
FILE_ARCHS = {ours: theirs for theirs, ours in GGUF_ARCHS.items()}


def arch_of(meta: dict) -> str:
    """quickdraft's name for the file's general.architecture (a clear error for one it does not run)."""
    arch = meta.get("general.architecture", "?")
    if GGUF_ARCHS.get(arch, arch) not in SUPPORTED_ARCHS:
        names = ", ".join(FILE_ARCHS.get(a, a) for a in SUPPORTED_ARCHS)
        raise QuickdraftError(f"unsupported architecture {arch!r} in the GGUF file: quickdraft runs {names}")
    return GGUF_ARCHS.get(arch, arch)


def config(meta: dict, shapes: dict[str, tuple[int, ...]], small: dict[str, list[float]]) -> ModelConfig:
    """meta: the file's key/values; shapes: each tensor's shape (fastest dimension last); small: the values of the
    CONFIG_TENSORS present."""
    ours = arch_of(meta)
    arch = meta["general.architecture"]  # the metadata's keys are under the file's name

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise QuickdraftError(f"the GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    n_heads, dim, blocks = _count(get, "attention.head_count"), _count(get, "embedding_length"), _count(get, "block_count")
    present = {int(m.group(1)) for name in shapes if (m := re.match(r"blk\.(\d+)\.", name))}
    if present != set(range(blocks)):
        raise QuickdraftError(f"the GGUF metadata says {arch}.block_count = {blocks}, but the file holds tensors for "
                              f"{len(present)} layers: the file is inconsistent")
    mtp = int(meta.get(f"{arch}.nextn_predict_layers") or 0)  # multi-token-prediction blocks after the decoder's
    layers = blocks - mtp
    if not 0 <= mtp < blocks:
        raise QuickdraftError(f"the GGUF metadata says {arch}.nextn_predict_layers = {mtp} of {blocks} blocks: the "
                              "file is inconsistent")
    embedding = shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2 or embedding[1] != dim:
        raise QuickdraftError(f"the GGUF metadata says {arch}.embedding_length = {dim}, but token_embd.weight has "
                              f"shape {embedding}: the file is inconsistent")
    head_dim = _first(get("attention.key_length", dim // n_heads))
    kv_heads = get("attention.head_count_kv", n_heads)
    names = set(shapes)
    ffn = meta.get(f"{arch}.feed_forward_length") or meta.get(f"{arch}.expert_feed_forward_length")
    fields = dict(
        arch=ours, vocab_size=embedding[0], dim=dim, n_layers=layers, n_heads=n_heads, n_kv_heads=_first(kv_heads),
        head_dim=head_dim, ffn_dim=_first(ffn if ffn is not None else get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_theta=float(get("rope.freq_base", 10000.0)),
        max_context=get("context_length", 4096),
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm=any(f"blk.{i}.attn_q_norm.weight" in names for i in range(layers)),
        tie_embeddings="output.weight" not in names,
    )
    fields["rope"] = _rope(arch, get, meta, small, head_dim, fields["rope_theta"])
    if arch in GEMMAS:
        fields.update(activation="gelu_tanh", embed_scale=math.sqrt(dim), sandwich_norms=True,
                      final_softcap=meta.get(f"{arch}.final_logit_softcapping") or None)
    if arch in ("gemma2", "gemma3"):
        scale = math.sqrt(dim / n_heads) if layers in ((46,) if arch == "gemma2" else (62,)) else math.sqrt(head_dim)
        fields.update(attn_scale=1 / scale,
                      attn_softcap=meta.get("gemma2.attn_logit_softcapping") if arch == "gemma2" else None)
    fields.update(_windows(arch, meta, get, layers))
    if arch == "gemma3" and fields.get("layer_types"):
        fields["rope_local"] = RopeConfig(theta=float(meta.get("gemma3.rope.freq_base_swa", 10000.0)))
    if arch == "gemma4":
        fields.update(_gemma4(meta, get, shapes, small, fields, kv_heads))
    if ours in HYBRID_ARCHS:
        fields.update(_hybrid(meta, get, shapes, fields, layers, mtp))
    if meta.get(f"{arch}.expert_count"):
        fields.update(_experts(get, shapes, layers))
    return ModelConfig(**fields)


def _first(value):
    """A per-layer array's first value (gemma4 writes some as arrays), or the value itself."""
    return value[0] if isinstance(value, list) else value


def _count(get, key: str) -> int:
    value = get(key)
    if not isinstance(value, int) or value <= 0:
        raise QuickdraftError(f"the GGUF metadata has {key} = {value!r}: it must be a positive whole number")
    return value


def _rope(arch: str, get, meta: dict, small: dict, head_dim: int, theta: float) -> RopeConfig:
    scaling = meta.get(f"{arch}.rope.scaling.type") or "none"
    dims = meta.get(f"{arch}.rope.dimension_count")
    rotary = dims if arch == "phi3" and dims and dims != head_dim else None
    if arch == "phi3" and "rope_factors_long.weight" in small:
        return RopeConfig(theta=theta, scaling="longrope", rotary_dim=rotary,
                          original_context=int(get("rope.scaling.original_context_length", 4096)),
                          short_factors=tuple(small["rope_factors_short.weight"]),
                          long_factors=tuple(small["rope_factors_long.weight"]),
                          attention_factor=float(meta.get("phi3.rope.scaling.attn_factor", 1.0)))
    factors = tuple(small.get("rope_freqs.weight", ()))
    if arch == "gemma4":  # its rope_freqs are the global layers' proportional mask (below), not llama3's
        factors = ()
    if scaling == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=float(get("rope.scaling.factor")), rotary_dim=rotary,
                          freq_factors=factors)
    if scaling not in ("none", "linear"):
        raise QuickdraftError(f"this {arch} file uses RoPE scaling {scaling!r}, which quickdraft does not implement "
                              "(it does linear, llama3's rope_freqs and Phi-3's long/short factors)")
    return RopeConfig(theta=theta, rotary_dim=rotary, freq_factors=factors)


def _windows(arch: str, meta: dict, get, layers: int) -> dict:
    """Sliding-window layers: which, and their window."""
    window = meta.get(f"{arch}.attention.sliding_window") or 0
    if arch == "gemma2":
        window = window or 4096
    if not window or arch not in ("gemma2", "gemma3", "gemma4", "mistral", "phi3"):
        return {}
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer, true where sliding
        if len(pattern) != layers:
            raise QuickdraftError(f"the GGUF metadata has {len(pattern)} values in {arch}.attention.sliding_window_"
                                  f"pattern for {layers} layers: the file is inconsistent")
        kinds = ["sliding" if p else "full" for p in pattern]
    else:
        n = pattern or {"gemma2": 2, "gemma3": 6}.get(arch, 0)  # llama.cpp's defaults for the family
        kinds = ["sliding" if not n or i % n < n - 1 else "full" for i in range(layers)]
    return {"sliding_window": int(window), "layer_types": tuple(kinds)}


def _gemma4(meta: dict, get, shapes: dict, small: dict, fields: dict, kv_heads) -> dict:
    kinds = fields.get("layer_types") or ("full",) * fields["n_layers"]
    full = next((i for i, k in enumerate(kinds) if k == "full"), None)
    head_full = get("attention.key_length")
    head_swa = meta.get("gemma4.attention.key_length_swa", head_full)
    kv_full = kv_heads[full] if isinstance(kv_heads, list) and full is not None else None
    kv_swa = next((kv_heads[i] for i, k in enumerate(kinds) if k == "sliding"), kv_full) if isinstance(kv_heads, list) \
        else kv_heads
    ple = int(meta.get("gemma4.embedding_length_per_layer_input") or 0)
    ffn = get("feed_forward_length")
    shared = int(meta.get("gemma4.attention.shared_kv_layers") or 0)
    rope_full, masks = fields["rope"], small.get("rope_freqs.weight")
    if masks is not None:  # 1 where a frequency rotates, 1e30 where it does not (proportional rope)
        keep = sum(1 for f in masks if f < 1e10)
        rope_full = RopeConfig(theta=rope_full.theta, scaling="proportional", fraction=keep / len(masks))
    k_eq_v = full is not None and f"blk.{full}.attn_k.weight" in shapes and f"blk.{full}.attn_v.weight" not in shapes
    return dict(
        head_dim=head_swa, head_dim_full=head_full if head_full != head_swa else None, n_kv_heads=kv_swa,
        n_kv_heads_full=kv_full if kv_full not in (None, kv_swa) else None, attn_scale=1.0, v_norm=True, k_eq_v=k_eq_v,
        kv_shared_layers=shared, ffn_dim=_first(ffn),
        ffn_dim_shared=ffn[-1] if isinstance(ffn, list) and ffn[-1] != ffn[0] else None,
        ple_dim=ple, ple_vocab=shapes["per_layer_token_embd.weight"][0] if ple else 0, layer_scalar=True,
        rope=rope_full, rope_local=RopeConfig(theta=float(meta.get("gemma4.rope.freq_base_swa", 10000.0))),
    )


def _hybrid(meta: dict, get, shapes: dict, fields: dict, layers: int, mtp: int) -> dict:
    """Qwen3.5's Gated DeltaNet layers as llama.cpp's converter describes them: which layers are recurrent, the
    heads (ssm.group_count key heads of ssm.state_size, ssm.time_step_rank value heads, ssm.inner_size values in
    all), the convolution; its value heads in tiled order (the converter reorders them for ggml's broadcast); the
    full layers' output gate (their attn_q holds a gate per head too) and partial rotary."""
    arch = meta["general.architecture"]
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if isinstance(recurrent, list):
        kinds = tuple("linear" if r else "full" for r in recurrent[:layers])
    else:
        interval = int(get("full_attention_interval", 4))
        kinds = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    v_heads = _count(get, "ssm.time_step_rank")
    inner = _count(get, "ssm.inner_size")
    if inner % v_heads:
        raise QuickdraftError(f"the GGUF metadata has {arch}.ssm.inner_size = {inner} for {v_heads} value heads "
                              "(ssm.time_step_rank): the file is inconsistent")
    full = next((i for i, k in enumerate(kinds) if k == "full"), None)
    q_rows = shapes.get(f"blk.{full}.attn_q.weight", (0,))[0] if full is not None else 0
    rope = fields["rope"]
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary and rotary != fields["head_dim"]:
        rope = RopeConfig(theta=rope.theta, rotary_dim=int(rotary))
    return dict(layer_types=kinds, linear_k_heads=_count(get, "ssm.group_count"), linear_v_heads=v_heads,
                linear_k_dim=_count(get, "ssm.state_size"), linear_v_dim=inner // v_heads,
                linear_conv=_count(get, "ssm.conv_kernel"), linear_v_tiled=True,
                attn_output_gate=q_rows == 2 * fields["n_heads"] * fields["head_dim"], rope=rope, mtp_layers=mtp)


def _experts(get, shapes: dict, layers: int) -> dict:
    """The mixture of experts: expert_count experts, expert_used_count a token, each expert_feed_forward_length
    wide, their weights renormalised over the chosen ones (llama.cpp's qwen3moe and qwen35moe always do), a shared
    expert where expert_shared_feed_forward_length says; layers without ffn_gate_exps are dense."""
    return dict(n_experts=_count(get, "expert_count"), experts_per_token=_count(get, "expert_used_count"),
                expert_ffn_dim=_count(get, "expert_feed_forward_length"),
                norm_topk=bool(get("expert_weights_norm", True)),
                shared_expert_ffn_dim=int(get("expert_shared_feed_forward_length", 0)),
                dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in shapes))
