"""EAGLE-3 heads from their checkpoints in vLLM's `speculators` format: config.json with `speculators_model_type`
"eagle3" (its decoder layer described by `transformer_layer_config`, its verifier by `speculators_config`), weights
in safetensors. Their config, their weights in a runtime format, and what they take before loading. The head itself
is tensor math (models/eagle3.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from quickdraft.errors import QuickdraftError, read_json
from quickdraft.models import rope as ropes
from quickdraft.models.eagle3 import ACTIVATIONS, Eagle3, Eagle3Config
from quickdraft.weights import heads
from quickdraft.weights.families.base import hf_ropes

# ModelConfig fields of decoder layers a head's layers do not have: a transformer_layer_config setting any of them
# (gemma's, hybrids', MoE layers) is refused rather than run wrongly
UNREAD = ("embed_scale", "sandwich_norms", "attn_scale", "attn_softcap", "head_dim_full", "k_eq_v", "v_norm",
          "layer_scalar", "attn_output_gate", "n_experts", "ple_dim", "linear_k_heads")


def speculators_type(source: str) -> str | None:
    """The `speculators_model_type` of the checkpoint in directory source (eagle3, dspark, dflash, ...), or None
    where it is none."""
    try:
        d = json.loads((Path(source).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    kind = d.get("speculators_model_type") if isinstance(d, dict) else None
    return kind if isinstance(kind, str) else None


def is_eagle3(source: str) -> bool:
    return speculators_type(source) == "eagle3"


def read_config(path: Path) -> Eagle3Config:
    d = read_json(path / "config.json")
    if d.get("speculators_model_type") != "eagle3":
        raise QuickdraftError(f"{path} holds no EAGLE-3 head (config.json's speculators_model_type is "
                              f"{d.get('speculators_model_type')!r}, not 'eagle3')")
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise QuickdraftError(f"{path}/config.json lacks 'transformer_layer_config', which an EAGLE-3 head needs")
    layer = _layer_config(path, tl)
    activation = tl.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise QuickdraftError(f"{path}: hidden_act {activation!r} is not one quickdraft runs "
                              f"({', '.join(ACTIVATIONS)})")
    if d.get("norm_before_fc") and d.get("fc_norm"):
        raise QuickdraftError(f"{path}/config.json sets both norm_before_fc and fc_norm: they exclude each other")
    try:
        heads, dim, n_layers = layer.n_heads, layer.dim, layer.n_layers
        head_dim = layer.head_dim
        layers = d.get("eagle_aux_hidden_state_layer_ids") or ()  # none: the library's default (default_layers)
        vocab = int(tl["vocab_size"])
        types = tl.get("layer_types") or []
        cfg = Eagle3Config(
            dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=layer.n_kv_heads,
            head_dim=head_dim, ffn_dim=layer.ffn_dim, norm_eps=layer.norm_eps,
            rope=hf_ropes(tl, head_dim)[0], vocab_size=vocab, draft_vocab=int(d.get("draft_vocab_size", vocab)),
            aux_layers=tuple(int(i) for i in layers), qk_norm=layer.qk_norm,
            attention_bias=layer.qkv_bias, mlp_bias=bool(tl.get("mlp_bias", False)),
            activation=activation,
            layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
            sliding_window=tl.get("sliding_window"),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            norm_before_fc=bool(d.get("norm_before_fc", False)), fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)), own_embedding=_has(path, "embed_tokens.weight"))
    except KeyError as e:
        raise QuickdraftError(f"{path}/config.json lacks {e.args[0]!r}, which an EAGLE-3 head needs") from None
    if cfg.layer_types and len(cfg.layer_types) != n_layers:
        raise QuickdraftError(f"{path}/config.json: layer_types names {len(cfg.layer_types)} layers, "
                              f"num_hidden_layers is {n_layers}")
    return cfg


def _layer_config(path: Path, tl: dict):
    """The head's decoder layers as quickdraft's ModelConfig describes a model of their family (weights/families/;
    the library's default layer is Qwen3's), refused where they have what a head's layers here do not."""
    from dataclasses import fields

    from quickdraft.config import ModelConfig
    from quickdraft.weights.hf_config import model_config

    tl = {"model_type": "qwen3", **tl}
    try:
        layer = model_config(tl)
    except QuickdraftError as e:
        raise QuickdraftError(f"{path}: its transformer_layer_config: {e}") from None
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    unread = [name for name in UNREAD if getattr(layer, name) != defaults[name]]
    if unread or layer.layer_types and "linear" in layer.layer_types:
        what = ", ".join(unread) or "linear attention"
        raise QuickdraftError(f"{path}: an EAGLE-3 head of {tl['model_type']} layers ({what}) is not read; quickdraft "
                              "reads heads of plain decoder layers (llama's, qwen3's and the like)")
    return layer


def default_layers(n_layers: int) -> tuple[int, ...]:
    """The layer ids a head reads when its config names none (the library's and vLLM's default for a verifier of
    n_layers): 2, n // 2 and n - 3."""
    return (2, n_layers // 2, n_layers - 3)


def for_target(cfg: Eagle3Config, n_layers: int) -> Eagle3Config:
    """cfg with its layer ids resolved for a target of n_layers where the config names none."""
    from dataclasses import replace

    return cfg if cfg.aux_layers else replace(cfg, aux_layers=default_layers(n_layers))


def check_target(cfg: Eagle3Config, name: str, target) -> None:
    """QuickdraftError, naming the mismatch and the fix, where the head was made for another target than `target`
    (a LoadedModel): another width or vocabulary, or layers it does not have."""
    tcfg = target.config
    fix = "give the EAGLE-3 head made for this target"
    if cfg.dim != tcfg.dim:
        raise QuickdraftError(f"{name} was made for a target {cfg.dim} wide; {target.name} is {tcfg.dim} wide: {fix}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise QuickdraftError(f"{name} was made for a target of {cfg.vocab_size} tokens; {target.name} has "
                              f"{tcfg.vocab_size}: {fix}")
    cfg = for_target(cfg, tcfg.n_layers)
    if max(cfg.aux_layers) > tcfg.n_layers or min(cfg.aux_layers) < 0:
        raise QuickdraftError(f"{name} reads the target's hidden states at layer ids {list(cfg.aux_layers)}; "
                              f"{target.name} has {tcfg.n_layers} layers (ids 0 to {tcfg.n_layers}): {fix}")
    if min(cfg.aux_layers) == 0:
        raise QuickdraftError(f"{name} reads layer id 0, the target's embeddings, which quickdraft does not keep for "
                              "drafters (it keeps layers' outputs, ids 1 and up): give a head that reads layers")


def _names(path: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as opened:
            for name in opened.keys():
                shapes[name] = list(opened.get_slice(name).get_shape())
    return shapes


def _has(path: Path, name: str) -> bool:
    return name in _names(path)


def load(path: Path, max_context: int, dtype: torch.dtype, device: torch.device, weights: str = "bf16",
         n_target_layers: int = 0) -> Eagle3:
    """The head in `path` for a target of n_target_layers (where its config names no layer ids), its linear layers
    in `weights` (quant.FORMATS: int8 / int4 where their kernels take the shape; its output layer stays in `dtype`:
    a head quantized below int8 loses its acceptance)."""
    from safetensors.torch import load_file

    cfg = for_target(read_config(path), n_target_layers)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuickdraftError(f"{path} has no .safetensors weights for its EAGLE-3 head")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # (the reverse map: d2t says it all)
    for unused in ("verifier_lm_head.weight", "verifier_norm.weight"):  # training's, not drafting's
        tensors.pop(unused, None)
    tensors = {n.replace(".self_attn.", ".").replace(".mlp.", "."): t for n, t in tensors.items()}
    with torch.device("meta"):
        model = Eagle3(cfg, max_context)
    params = {n for n, _ in model.named_parameters()}
    missing, unexpected = sorted(params - set(tensors)), sorted(set(tensors) - params)
    if missing or unexpected:
        raise QuickdraftError(f"{path}: the weights do not match an EAGLE-3 head of its config (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]})")
    ids = heads.draft_ids(path, d2t, cfg.draft_vocab, cfg.vocab_size) if cfg.draft_vocab != cfg.vocab_size else \
        torch.arange(cfg.draft_vocab)
    heads.place(model, tensors, path, weights, dtype, device, keep_float=("lm_head",))
    model.target_ids = ids.to(device)
    cos, sin = ropes.tables(cfg.rope, cfg.head_dim, max_context)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval().requires_grad_(False)


def weight_bytes(path: Path, element: int = 2) -> int:
    """Bytes of the head's weights at `element` bytes each (from the safetensors headers: nothing else is read)."""
    return sum(element * math.prod(shape) for name, shape in _names(path).items()
               if name not in ("d2t", "t2d", "verifier_lm_head.weight", "verifier_norm.weight"))
