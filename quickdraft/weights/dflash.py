"""DFlash and DFlash2 drafters from their checkpoints (z-lab's form: config.json naming DFlashDraftModel or
DFlash2DraftModel, or holding a dflash_config; safetensors weights): their config, their weights in a runtime format,
and what they take before loading. The drafter itself is tensor math (models/dflash.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from quickdraft.errors import QuickdraftError, read_json
from quickdraft.models import rope as ropes
from quickdraft.models.dflash import DFlash, DFlashConfig
from quickdraft.weights import heads
from quickdraft.weights.families.base import hf_ropes


def is_dflash(source: str) -> bool:
    """Whether source is a directory holding a DFlash or DFlash2 drafter (config.json names the architecture, or
    has a dflash_config)."""
    try:
        return _kind(_read(Path(source).expanduser() / "config.json")) is not None
    except (OSError, ValueError):
        return False


def _read(path: Path) -> dict:
    if not path.is_file():
        raise OSError(path)
    return json.loads(path.read_text(encoding="utf-8"))


SPECULATORS = ("dflash", "dflash2", "dspark")  # the speculators_model_type values read here (vLLM's form)


def _kind(d: dict) -> str | None:
    if "speculators_model_type" in d:
        return d["speculators_model_type"] if d["speculators_model_type"] in SPECULATORS else None
    arch = " ".join(d.get("architectures") or [])
    if "DFlash2" in arch:
        return "dflash2"
    if "DFlash" in arch or isinstance(d.get("dflash_config"), dict):
        return "dflash2" if _value(d, "selector_top_k") else "dflash"
    return None


def _value(d: dict, name: str, default=None):
    """As the reference reads its settings: dflash_config first, the config's own key after."""
    inner = d.get("dflash_config") or {}
    return inner.get(name, d.get(name, default))


def target_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """The target layers a drafter reads when its config does not list them (the reference's default): the middle
    one for a single layer, else evenly from layer 1 to layer n_target - 3."""
    if n_draft == 1:
        return [n_target // 2]
    start, end = 1, n_target - 3
    return [round(start + i * (end - start) / (n_draft - 1)) for i in range(n_draft)]


def read_config(path: Path) -> DFlashConfig:
    d = read_json(path / "config.json")
    kind = _kind(d)
    if kind is None:
        raise QuickdraftError(f"{path} holds no DFlash drafter (config.json names no DFlash architecture)")
    if "speculators_model_type" in d:
        return _speculators(path, d, kind)
    try:
        heads, dim, n_layers = d["num_attention_heads"], d["hidden_size"], d["num_hidden_layers"]
        head_dim = d.get("head_dim") or dim // heads
        layers = _value(d, "target_layer_ids") or target_layer_ids(int(d["num_target_layers"]), n_layers)
        mask = _value(d, "mask_token_id")
        if mask is None:
            raise KeyError("mask_token_id")
        types = d.get("layer_types") or ["full_attention"] * n_layers
        softcap = _value(d, "final_logit_softcapping")
        cfg = DFlashConfig(
            dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim, ffn_dim=d["intermediate_size"], norm_eps=d.get("rms_norm_eps", 1e-6),
            bias=bool(d.get("attention_bias", False)), rope=hf_ropes(d, head_dim)[0],
            vocab_size=d["vocab_size"], target_layers=tuple(int(i) for i in layers),
            block_size=int(_value(d, "block_size", 16)), mask_token=int(mask),
            layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
            sliding_window=d.get("sliding_window"),
            causal=None if d.get("is_causal") is None else bool(d["is_causal"]),
            embedding_scale=float(_value(d, "input_embedding_scale", 1.0)),
            output_multiplier=float(_value(d, "output_multiplier", 1.0)),
            softcap=float(softcap) if softcap is not None and float(softcap) > 0 else None, kind=kind)
        if kind == "dflash2":
            cfg = _dflash2(cfg, d)
    except KeyError as e:
        raise QuickdraftError(f"{path}/config.json lacks {e.args[0]!r}, which a DFlash drafter needs") from None
    if cfg.block_size < 2:
        raise QuickdraftError(f"{path}/config.json: block_size {cfg.block_size} drafts nothing (it must be 2 or more)")
    return cfg


def _speculators(path: Path, d: dict, kind: str) -> DFlashConfig:
    """A block drafter in vLLM's speculators form: its layers described by transformer_layer_config (Qwen3's), the
    target layers it reads by aux_hidden_state_layer_ids (vLLM's convention: id i is the output of layer i - 1),
    its own output layer over a draft vocabulary where draft_vocab_size is less than the target's; DFlash2's
    convolutions and candidate selector (their fields at the config's top level); DSpark's Markov and confidence
    heads."""
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise QuickdraftError(f"{path}/config.json lacks 'transformer_layer_config', which a {kind} drafter needs")
    try:
        heads, dim, n_layers = tl["num_attention_heads"], tl["hidden_size"], tl["num_hidden_layers"]
        head_dim = tl.get("head_dim") or 128  # Qwen3Config's default
        ids = d.get("aux_hidden_state_layer_ids")
        if not ids:
            raise KeyError("aux_hidden_state_layer_ids")
        if d.get("mask_token_id") is None:
            raise KeyError("mask_token_id")
        vocab = int(tl["vocab_size"])
        draft_vocab = int(d.get("draft_vocab_size", vocab))
        types = tl.get("layer_types") or ["full_attention"] * n_layers
        if "sliding_attention" in types:
            raise QuickdraftError(f"{path}: a {kind} drafter with sliding-window layers (windows counted from the "
                                  "block's first row) is not read yet")
        if min(int(i) for i in ids) < 1:
            raise QuickdraftError(f"{path} reads the target's layer ids {list(ids)}: id 0 (the embeddings) is not "
                                  "kept for drafters")
        markov = int(d.get("markov_rank", 256)) if kind == "dspark" else 0
        confidence = bool(d.get("enable_confidence_head", True)) if kind == "dspark" else False
        cfg = DFlashConfig(
            dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=tl.get("num_key_value_heads") or heads,
            head_dim=head_dim, ffn_dim=tl["intermediate_size"], norm_eps=tl.get("rms_norm_eps", 1e-6),
            bias=bool(tl.get("attention_bias", False)), rope=hf_ropes(tl, head_dim)[0], vocab_size=vocab,
            target_layers=tuple(int(i) - 1 for i in ids), block_size=int(d.get("block_size", 8)),
            mask_token=int(d["mask_token_id"]), layer_types=("full",) * n_layers, kind=kind,
            draft_vocab=draft_vocab if draft_vocab != vocab else 0,
            sample_from_anchor=bool(d.get("sample_from_anchor", kind == "dspark")),
            markov_rank=markov, markov_type=d.get("markov_head_type", "vanilla"), confidence=confidence,
            confidence_with_markov=confidence and bool(d.get("confidence_head_with_markov", True)))
    except KeyError as e:
        raise QuickdraftError(f"{path}/config.json lacks {e.args[0]!r}, which a {kind} drafter needs") from None
    if kind == "dflash2":
        if cfg.draft_vocab:
            raise QuickdraftError(f"{path}: a DFlash2 drafter scores the target's whole vocabulary (its selector's "
                                  f"codebooks index it); draft_vocab_size {cfg.draft_vocab} is not the target's")
        try:
            cfg = _dflash2(cfg, d)
        except KeyError as e:
            raise QuickdraftError(f"{path}/config.json lacks {e.args[0]!r}, which a dflash2 drafter needs") from None
    if cfg.markov_type not in ("vanilla", "gated", "rnn"):
        raise QuickdraftError(f"{path}: markov_head_type {cfg.markov_type!r} is not one of vanilla, gated, rnn")
    if cfg.confidence_with_markov and not cfg.markov_rank:
        raise QuickdraftError(f"{path}: its confidence head reads the Markov head's embedding, and markov_rank is 0")
    if cfg.block_size < 2:
        raise QuickdraftError(f"{path}/config.json: block_size {cfg.block_size} drafts nothing (it must be 2 or more)")
    return cfg


def _dflash2(cfg: DFlashConfig, d: dict) -> DFlashConfig:
    from dataclasses import replace

    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if _value(d, name) is None:
            raise KeyError(name)
    return replace(cfg, conv_kernel=int(_value(d, "conv_kernel_size")), conv_group=int(_value(d, "conv_group_size")),
                   selector_rank=int(_value(d, "selector_rank")), selector_top_k=int(_value(d, "selector_top_k")))


def load(path: Path, target_dim: int, max_context: int, dtype: torch.dtype, device: torch.device,
         weights: str = "bf16") -> DFlash:
    """The drafter in `path` (config.json and safetensors) for a target `target_dim` wide, its linear layers in
    `weights` (quant.FORMATS: int8 / int4 where their kernels take the shape)."""
    from safetensors.torch import load_file

    cfg = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuickdraftError(f"{path} has no .safetensors weights for its DFlash drafter")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            name = name.removeprefix("model.")
            if name.startswith("candidate_selector.") and name.endswith("_codebook"):
                name += ".weight"  # the reference's checkpoints name the codebooks without .weight
            tensors[name] = t
    d2t = tensors.pop("d2t", None)
    for unused in ("t2d", "verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight"):
        tensors.pop(unused, None)  # training's, or the target's own (the speculators form reads the target's table)
    tensors = {_our_name(n): t for n, t in tensors.items()}
    with torch.device("meta"):
        model = DFlash(cfg, target_dim, max_context)
    params = {n for n, _ in model.named_parameters()}
    missing, unexpected = sorted(params - set(tensors)), sorted(set(tensors) - params)
    if missing or unexpected:
        raise QuickdraftError(f"{path}: the weights do not match a {cfg.kind} drafter of its config for a target "
                              f"{target_dim} wide (missing {missing[:3]}, unexpected {unexpected[:3]})")
    heads.place(model, tensors, path, weights, dtype, device, keep_float=("lm_head", "markov_head", "confidence_head"))
    model.target_ids = (heads.draft_ids(path, d2t, cfg.draft_vocab, cfg.vocab_size) if cfg.draft_vocab else
                        torch.arange(cfg.vocab_size)).to(device)
    cos, sin = ropes.tables(cfg.rope, cfg.head_dim, max_context + cfg.block_size)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.eval().requires_grad_(False)


def _our_name(name: str) -> str:
    """The reference's parameter names -> ours (attention's and the MLP's projections sit in the layer itself)."""
    return name.replace(".self_attn.", ".").replace(".mlp.", ".")


def weight_bytes(path: Path, element: int = 2) -> int:
    """Bytes of the drafter's weights at `element` bytes each (from the safetensors headers: nothing else is
    read)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as opened:
            for name in opened.keys():
                if name not in ("d2t", "t2d", "verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight"):
                    total += element * math.prod(opened.get_slice(name).get_shape())
    return total
