"""What a family file states (Family), and the view of a GGUF file's metadata its hooks read (Gguf)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from quickdraft.config import RopeConfig
from quickdraft.errors import QuickdraftError

_REQUIRED = object()


@dataclass(frozen=True)
class Gguf:
    """A GGUF file's metadata as a family reads it: its key/values (under the file's architecture name), each tensor's
    shape (fastest dimension last) and the values of the small tensors that are configuration (CONFIG_TENSORS)."""

    meta: dict
    shapes: dict[str, tuple[int, ...]]
    small: dict[str, list[float]]

    @property
    def arch(self) -> str:
        """The file's own name of its architecture (the metadata's keys are under it)."""
        return self.meta["general.architecture"]

    def get(self, key: str, default=_REQUIRED):
        """The value of `{arch}.{key}`; without a default, an error naming the key where the file lacks it."""
        value = self.meta.get(f"{self.arch}.{key}", None if default is _REQUIRED else default)
        if value is None and default is _REQUIRED:
            raise QuickdraftError(f"the GGUF metadata lacks {self.arch}.{key}: the file is incomplete")
        return value

    def count(self, key: str) -> int:
        """A value that must be a positive whole number."""
        value = self.get(key)
        if not isinstance(value, int) or value <= 0:
            raise QuickdraftError(f"the GGUF metadata has {key} = {value!r}: it must be a positive whole number")
        return value


def _nothing(source, fields: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """One family of models: how its checkpoints describe it beyond the keys and tensor names every family shares
    (weights/gguf_config.py, weights/hf_config.py, weights/names.py read those), and the ModelConfig fields (the
    decoder's switches: models/transformer.py follows them) it sets. A family is a file in this folder that defines
    FAMILY; nothing else lists it."""

    name: str  # ModelConfig.arch
    gguf_arch: str | None = None  # general.architecture in llama.cpp's files (None: the same as name; "": none)
    hf_types: tuple[str, ...] = ()  # config.json model_type values of its text model
    hf_wrappers: tuple[str, ...] = ()  # model_type values of a multimodal wrapper holding it under text_config
    fields: dict = field(default_factory=dict)  # fields every checkpoint of it has, whatever its format
    hf_fields: dict = field(default_factory=dict)  # fields config.json leaves to the family (transformers' code)
    # its fields from a GGUF file's metadata and from config.json, given the shared ones read so far: (Gguf | dict,
    # fields) -> the fields to set
    gguf: Callable[[Gguf, dict], dict] = _nothing
    hf: Callable[[dict, dict], dict] = _nothing
    tied_by_default: bool = False  # config.json's tie_word_embeddings where it is left out
    # tensor names: a layer's (the part after blk.N. / model.layers.N.) beyond or instead of the shared ones
    gguf_names: dict[str, str] = field(default_factory=dict)
    hf_names: dict[str, str] = field(default_factory=dict)
    hf_ignored: tuple[str, ...] = ()  # config.json tensors (prefixes) of parts it does not run (a vision tower)
    rotary_permuted: bool = False  # llama.cpp's converter permutes the rows of wq and wk (interleaved rotary)
    one_centred_norms: bool = False  # config.json's norms hold w for a scale of 1 + w (folded in at load)
    hf_builders: dict[str, Callable[[dict], object]] = field(default_factory=dict)  # model_type -> ModelConfig, for
    #                                                                                  a kind it builds its own way

    @property
    def file_arch(self) -> str:
        return self.name if self.gguf_arch is None else self.gguf_arch


def windows(g: Gguf, layers: int, window: int = 0, every: int = 0) -> dict:
    """Sliding-window layers from a GGUF file: which, and their window (attention.sliding_window, else `window`);
    attention.sliding_window_pattern per layer (true where sliding), or one full layer in `every` (the family's
    default where the file leaves the pattern out; 0: every layer sliding). Nothing without a window."""
    window = g.get("attention.sliding_window", 0) or window
    if not window:
        return {}
    pattern = g.get("attention.sliding_window_pattern", None)
    if isinstance(pattern, list):  # per layer, true where sliding
        if len(pattern) != layers:
            raise QuickdraftError(f"the GGUF metadata has {len(pattern)} values in {g.arch}.attention.sliding_window_"
                                  f"pattern for {layers} layers: the file is inconsistent")
        kinds = ["sliding" if p else "full" for p in pattern]
    else:
        n = pattern or every
        kinds = ["sliding" if not n or i % n < n - 1 else "full" for i in range(layers)]
    return {"sliding_window": int(window), "layer_types": tuple(kinds)}


def hf_ropes(d: dict, head_dim: int, partial: float = 1.0) -> tuple:
    """The rotary of config.json's full layers and of its sliding layers (None where the same): transformers 5's
    rope_parameters (per layer type, or one for all), else the older rope_theta / rope_scaling keys. partial: the
    share of each head it rotates where the config does not say (the family's default)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (gemma3, gemma4 in transformers 5)
        local = params.get("sliding_attention")
        return hf_rope(params["full_attention"], d, head_dim), hf_rope(local, d, head_dim) if local else None
    flat = dict(params or {})
    if not flat:  # transformers 4.x keys
        flat = dict(d.get("rope_scaling") or {})
        flat["rope_theta"] = d.get("rope_theta", 10000.0)
    if partial != 1.0 and "partial_rotary_factor" not in flat and "partial_rotary_factor" not in d:
        flat["partial_rotary_factor"] = partial
    return hf_rope(flat, d, head_dim), None


def hf_rope(p: dict, d: dict, head_dim: int):
    """One rotary of config.json: default, linear, llama3, longrope (Phi-3's "su") or proportional (Gemma 4)."""
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


def hf_layer_types(d: dict) -> list[str] | None:
    """config.json's layer_types as quickdraft names them ("full", "sliding", "linear"), None where it has none."""
    kinds = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
    given = d.get("layer_types")
    if not given:
        return None
    unknown = sorted(set(given) - set(kinds))
    if unknown:
        raise QuickdraftError(f"config.json has layer types {unknown}: quickdraft runs full_attention, "
                              "sliding_attention and linear_attention")
    return [kinds[t] for t in given]
