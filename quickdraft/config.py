"""Frozen configuration dataclasses, built from a checkpoint's own metadata or from user input."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quickdraft.errors import QuickdraftError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer of the llama / qwen2 / qwen3 families."""

    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    max_context: int
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3: RMSNorm on each head of q and k
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise QuickdraftError(
                f"unsupported architecture {self.arch!r}: quickdraft runs {', '.join(SUPPORTED_ARCHS)}; "
                "use a model of one of these families"
            )
        for name, value, most in (("vocab_size", self.vocab_size, 1 << 22), ("dim", self.dim, 1 << 17),
                                  ("n_layers", self.n_layers, 1024), ("n_heads", self.n_heads, 1024),
                                  ("n_kv_heads", self.n_kv_heads, 1024), ("head_dim", self.head_dim, 1024),
                                  ("ffn_dim", self.ffn_dim, 1 << 20), ("max_context", self.max_context, 1 << 24)):
            if not (isinstance(value, int) and 0 < value <= most):
                raise QuickdraftError(f"model metadata is inconsistent: {name} = {value!r} (a model has 1 to {most})")
        if self.n_heads % self.n_kv_heads:
            raise QuickdraftError(
                f"model metadata is inconsistent: {self.n_heads} attention heads is not a multiple of "
                f"{self.n_kv_heads} key/value heads"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary; unknown keys are ignored."""
        model_type = d.get("model_type", "?")
        if model_type not in SUPPORTED_ARCHS:
            raise QuickdraftError(
                f"unsupported architecture {model_type!r} in config.json: quickdraft runs "
                f"{', '.join(SUPPORTED_ARCHS)}"
            )
        scaling = d.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise QuickdraftError(
                f"unsupported rope_scaling {scaling!r} in config.json: only plain RoPE is implemented"
            )
        n_heads = d["num_attention_heads"]
        rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            arch=model_type,
            vocab_size=d["vocab_size"],
            dim=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            ffn_dim=d["intermediate_size"],
            norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_context=d.get("max_position_embeddings", 4096),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        )

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a token. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off (llama.cpp's repeat_penalty over the last window)
    repetition_window: int = 64  # tokens the penalties look back over (0: the whole sequence)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token seen in the window
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the window
    seed: int | None = None
    max_tokens: int = 128
    stop_at_eos: bool = True

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0 (0 is greedy)"),
            (self.top_k >= 0, "top-k must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min-p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition penalty must be > 0 (1 turns it off)"),
            (-2 <= self.presence_penalty <= 2, "presence penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency penalty must be in [-2, 2]"),
            (self.max_tokens >= 0, "the number of tokens to generate must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise QuickdraftError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class SpeculationConfig:
    """How much to speculate. Flags mirror llama.cpp: --draft-max, --draft-min, --draft-p-min."""

    draft_max: int = 16  # most tokens drafted in a round
    draft_min: int = 0  # fewest when speculating; 0 lets the policy turn speculation off (plain decoding)
    p_min: float = 0.5  # the draft model stops a round early when its top probability falls below this
    adaptive: bool = True  # False: always draft draft_max tokens
    probe_every: int = 16  # while plain decoding wins, try one round after this many plain steps
    constrain_draft: bool = True  # under a grammar, mask the draft too (False: blind drafts, as llama.cpp)

    def __post_init__(self):
        if not 0 <= self.draft_min <= self.draft_max:
            raise QuickdraftError("--draft-min and --draft-max must satisfy 0 <= draft-min <= draft-max")
        if self.draft_max > 63:
            raise QuickdraftError("--draft-max above 63 is never useful: rounds that long are rejected early")
        if not 0 <= self.p_min < 1:
            raise QuickdraftError("--draft-p-min must be in [0, 1)")


@dataclass(frozen=True)
class EngineConfig:
    """Where and how a model runs."""

    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    weights: str = "auto"  # auto | bf16 (the dtype's) | int8 | int4 | mixed (weight-only, CPU)
    max_context: int | None = None  # None: the model's own, capped at DEFAULT_MAX_CONTEXT
    threads: int | None = None
    cuda_graphs: bool = True  # on CUDA, replay decode and verification passes as CUDA graphs (runtime/graphs.py)
    weight_cache: bool = True  # keep quantized conversions on disk for the next load (weights/converted.py)


DEFAULT_MAX_CONTEXT = 4096
