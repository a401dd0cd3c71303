"""Frozen configuration dataclasses, built from a checkpoint's own metadata or from user input."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from quickdraft.errors import QuickdraftError

SCALINGS = ("default", "linear", "llama3", "longrope", "proportional")


@dataclass(frozen=True)
class RopeConfig:
    """A model's rotary position embedding: its base and scaling scheme (models/rope.py computes its tables)."""

    theta: float = 10000.0
    scaling: str = "default"  # one of SCALINGS
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_context: int = 8192  # llama3, longrope: the context the model was trained with
    rotary_dim: int | None = None  # dimensions rotated (None: the whole head)
    fraction: float = 1.0  # proportional: the share of frequencies that rotate
    short_factors: tuple[float, ...] = ()  # longrope
    long_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos and sin are multiplied by it (longrope)
    freq_factors: tuple[float, ...] = field(default=())  # per-frequency divisors, from a GGUF rope_freqs tensor

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise QuickdraftError(f"unsupported rope scaling {self.scaling!r}: quickdraft implements "
                                  f"{', '.join(SCALINGS)}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, every family's described by the fields below (models/transformer.py
    follows them; `arch` names the family: weights/families/). Built from a checkpoint's own metadata:
    weights/hf_config.py (config.json) and weights/gguf_config.py (GGUF)."""

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
    qk_norm: bool = False  # qwen3, gemma3, gemma4: RMSNorm on each head of q and k
    tie_embeddings: bool = False
    rope: RopeConfig | None = None  # the full-attention layers' rotary (None: plain, at rope_theta)
    rope_local: RopeConfig | None = None  # the sliding-window layers' rotary where it differs (gemma3, gemma4)
    activation: str = "silu"  # the gated FFN's: silu (SwiGLU) or gelu_tanh (GeGLU: gemma)
    embed_scale: float = 1.0  # embeddings are multiplied by it (gemma: sqrt(dim))
    sandwich_norms: bool = False  # gemma2-4: norms after attention and after the FFN too, before the residual
    attn_scale: float | None = None  # attention logits' scale (None: 1 / sqrt(head_dim))
    attn_softcap: float | None = None  # gemma2: attention logits -> cap tanh(logits / cap)
    final_softcap: float | None = None  # gemma2, gemma4: the output logits likewise
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] | None = None  # per layer: "full" or "sliding" (None: all full, or all sliding
    #                                             where sliding_window is set)
    # gemma4
    head_dim_full: int | None = None  # full-attention layers' head size where it differs
    n_kv_heads_full: int | None = None  # and their key/value heads
    k_eq_v: bool = False  # full-attention layers take their values from their keys' projection (no v_proj)
    v_norm: bool = False  # values pass an RMSNorm without weight
    kv_shared_layers: int = 0  # the last layers reuse the keys and values of the last earlier layer of their kind
    ffn_dim_shared: int | None = None  # those layers' FFN width where it differs (double-wide MLP)
    ple_dim: int = 0  # per-layer embeddings: their width (0: none)
    ple_vocab: int = 0  # and their table's rows
    layer_scalar: bool = False  # each layer's output is multiplied by a learned scalar
    # qwen3_5 (Qwen3.5 / 3.6 hybrids): gated attention and Gated DeltaNet linear-attention layers ("linear" in
    # layer_types)
    attn_output_gate: bool = False  # q_proj also gives a gate per head: attention output * sigmoid(gate)
    linear_k_heads: int = 0  # a linear layer's query/key heads
    linear_v_heads: int = 0  # and value heads (a multiple of the key heads)
    linear_k_dim: int = 0  # their sizes
    linear_v_dim: int = 0
    linear_conv: int = 4  # the short causal convolution's kernel
    linear_v_tiled: bool = False  # value heads in llama.cpp's tiled order (value head j reads key head j mod the key
    #                               heads: its converter reorders them so) rather than transformers' grouped order
    #                               (j reads key head j // (value heads / key heads))
    # mixture of experts (qwen3_moe, qwen3_5_moe): the FFN of a MoE layer routes each token to experts_per_token of
    # n_experts SwiGLU experts, their outputs weighted by the router's softmax (renormalised over the chosen ones
    # where norm_topk), plus a shared expert gated by a sigmoid where shared_expert_ffn_dim
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_dim: int = 0
    norm_topk: bool = False
    shared_expert_ffn_dim: int = 0
    dense_layers: tuple[int, ...] = ()  # layers with a dense FFN among the MoE ones
    mtp_layers: int = 0  # qwen3.5: multi-token-prediction layers in the checkpoint (the `mtp` drafter runs them)
    # Gemma 4's assistant drafter (models/assistant.py): a gemma4 text model whose layers attend to a target's keys
    # and values, fed [the target's embedding of a token, its hidden state] (2 x assistant_backbone wide); its head
    # scores only the tokens of the `centroid_top_k` best of `centroids` clusters where centroids is set
    assistant_backbone: int = 0  # the target's width it was trained with (0: not an assistant)
    centroids: int = 0
    centroid_top_k: int = 0

    def __post_init__(self):
        for name, value, most in (("vocab_size", self.vocab_size, 1 << 22), ("dim", self.dim, 1 << 17),
                                  ("n_layers", self.n_layers, 1024), ("n_heads", self.n_heads, 1024),
                                  ("n_kv_heads", self.n_kv_heads, 1024), ("head_dim", self.head_dim, 1024),
                                  ("ffn_dim", self.ffn_dim, 1 << 20), ("max_context", self.max_context, 1 << 24)):
            if not (isinstance(value, int) and 0 < value <= most):
                raise QuickdraftError(f"model metadata is inconsistent: {name} = {value!r} (a model has 1 to {most})")
        for heads in {self.n_kv_heads, self.n_kv_heads_full or self.n_kv_heads}:
            if self.n_heads % heads:
                raise QuickdraftError(
                    f"model metadata is inconsistent: {self.n_heads} attention heads is not a multiple of "
                    f"{heads} key/value heads"
                )
        if self.rope is None:
            object.__setattr__(self, "rope", RopeConfig(theta=self.rope_theta))
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise QuickdraftError(f"model metadata is inconsistent: {len(self.layer_types)} layer types for "
                                  f"{self.n_layers} layers")
        if self.layer_types is not None and "linear" in self.layer_types:
            if not all(n > 0 for n in (self.linear_k_heads, self.linear_v_heads, self.linear_k_dim, self.linear_v_dim,
                                       self.linear_conv)) or self.linear_v_heads % self.linear_k_heads:
                raise QuickdraftError(
                    f"model metadata is inconsistent: linear-attention layers with {self.linear_k_heads} key heads of "
                    f"{self.linear_k_dim} and {self.linear_v_heads} value heads of {self.linear_v_dim}, kernel "
                    f"{self.linear_conv} (value heads must be a multiple of key heads)")
        if self.n_experts and not (0 < self.experts_per_token <= self.n_experts and self.expert_ffn_dim > 0):
            raise QuickdraftError(f"model metadata is inconsistent: {self.experts_per_token} of {self.n_experts} "
                                  f"experts per token, each {self.expert_ffn_dim} wide")
        if self.activation not in ("silu", "gelu_tanh"):
            raise QuickdraftError(f"unsupported activation {self.activation!r}: quickdraft runs silu and gelu_tanh")
        if not 0 <= self.kv_shared_layers < self.n_layers:
            raise QuickdraftError(f"model metadata is inconsistent: {self.kv_shared_layers} layers sharing keys and "
                                  f"values of {self.n_layers}")

    # ---- per layer ------------------------------------------------------------------------------------------

    def layer_kind(self, i: int) -> str:
        """"full", "sliding" (a sliding-window attention layer) or "linear" (a Gated DeltaNet layer)."""
        if self.layer_types is not None:
            return self.layer_types[i]
        return "sliding" if self.sliding_window else "full"

    def head_dim_of(self, i: int) -> int:
        return self.head_dim_full if self.head_dim_full and self.layer_kind(i) == "full" else self.head_dim

    def kv_heads_of(self, i: int) -> int:
        return self.n_kv_heads_full if self.n_kv_heads_full and self.layer_kind(i) == "full" else self.n_kv_heads

    def rope_of(self, i: int) -> RopeConfig:
        return self.rope_local if self.rope_local is not None and self.layer_kind(i) == "sliding" else self.rope

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends to: itself, or for a layer sharing them (gemma4's
        last kv_shared_layers), the last earlier layer of its kind that has its own."""
        first_shared = self.n_layers - self.kv_shared_layers
        if i < first_shared:
            return i
        same = [j for j in range(first_shared) if self.layer_kind(j) == self.layer_kind(i)]
        if not same:
            raise QuickdraftError(f"model metadata is inconsistent: layer {i} shares the keys and values of an "
                                  f"earlier {self.layer_kind(i)} layer, and there is none")
        return same[-1]

    def is_moe(self, i: int) -> bool:
        return self.n_experts > 0 and i not in self.dense_layers

    def ffn_dim_of(self, i: int) -> int:
        return self.ffn_dim_shared if self.ffn_dim_shared and self.kv_source(i) != i else self.ffn_dim

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From dataclasses.asdict's dictionary (a kept conversion's)."""
        d = dict(d)
        for key in ("rope", "rope_local"):
            if isinstance(d.get(key), dict):
                d[key] = RopeConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d[key].items()})
        for key in ("layer_types", "dense_layers"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_DRAFT = 63  # the most tokens a round may draft: rounds that long are rejected early anyway
# Each sampling setting's bounds, declared once: SamplingParams checks them (with the hint after them), the server's
# request model states them (as pydantic Field constraints: server/protocol.py).
SAMPLING_BOUNDS = {
    "temperature": ({"ge": 0}, "0 is greedy"),
    "top_k": ({"ge": 0}, "0 turns it off"),
    "top_p": ({"gt": 0, "le": 1}, "1 turns it off"),
    "min_p": ({"ge": 0, "lt": 1}, "0 turns it off"),
    "repetition_penalty": ({"gt": 0}, "1 turns it off"),
    "presence_penalty": ({"ge": -2, "le": 2}, "0 turns it off"),
    "frequency_penalty": ({"ge": -2, "le": 2}, "0 turns it off"),
}
_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_TESTS = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b, "lt": lambda v, b: v < b}


def bounds_error(name: str, value) -> str | None:
    """What is wrong with a sampling setting's value (SAMPLING_BOUNDS), None when it is within its bounds."""
    bounds, hint = SAMPLING_BOUNDS[name]
    if all(_TESTS[op](value, b) for op, b in bounds.items()):
        return None
    wanted = " and ".join(f"{_SIGNS[op]} {b}" for op, b in bounds.items())
    return f"{name.replace('_', ' ').replace('top ', 'top-').replace('min p', 'min-p')} must be {wanted} ({hint})"


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
    # log-probabilities of each chosen token (and of the `logprobs` likeliest, 0: none) from the target's logits
    # at its position: None is off; raw (the model's own distribution, as OpenAI, vLLM and llama.cpp give by
    # default) or, with post_sampling, the distribution the token was drawn from (penalties, grammar, temperature,
    # truncation: greedy is certain). Speculation never changes them: they come from the same logits.
    logprobs: int | None = None
    post_sampling: bool = False

    def __post_init__(self):
        for name in SAMPLING_BOUNDS:
            message = bounds_error(name, getattr(self, name))
            if message:
                raise QuickdraftError(message)
        checks = [
            (self.max_tokens >= 0, "the number of tokens to generate must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"the number of top log-probabilities must be in [0, {MAX_TOP_LOGPROBS}]"),
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
    """How much to speculate (the command line's flags mirror llama.cpp's: --draft-max, --draft-min, --draft-p-min)."""

    draft_max: int = 16  # most tokens drafted in a round
    draft_min: int = 0  # fewest when speculating; 0 lets the policy turn speculation off (plain decoding)
    p_min: float = 0.5  # the draft model stops a round early when its top probability falls below this
    adaptive: bool = True  # False: always draft draft_max tokens
    probe_every: int = 16  # while plain decoding wins, try one round after this many plain steps
    constrain_draft: bool = True  # under a grammar, mask the draft too (False: blind drafts, as llama.cpp)
    draft_vocab: int = 0  # a draft model scores its first this many ids and the text's (speculative/subset.py); 0: all
    # tree verification: up to this many candidates at the chain's least sure position, verified in the same pass
    # (1: chains alone); adaptive, the policy verifies a tree only while it measures faster than the chain
    tree: int = 1
    # a draft model drafts from its first tokens and the last draft_window of the rest (0: the whole context; None:
    # the default for its device: speculative/draft_model.window_of), so its cost does not grow with the prompt
    draft_window: int | None = None
    # suffix decoding's history (speculative/suffix.py): at most this many tokens of earlier answers kept per client to
    # draft from (0: none; the request's own prompt and answer are always drafted from)
    draft_history: int = 16384

    def __post_init__(self):
        if not 0 <= self.draft_min <= self.draft_max:
            raise QuickdraftError("{draft_min} and {draft_max} must satisfy 0 <= {draft_min} <= {draft_max}",
                                  "draft_min", "draft_max")
        if self.draft_max > MAX_DRAFT:
            raise QuickdraftError(f"{{draft_max}} above {MAX_DRAFT} is never useful: rounds that long are rejected "
                                  "early", "draft_max")
        if not 0 <= self.p_min < 1:
            raise QuickdraftError("{p_min} must be in [0, 1)", "p_min")
        if not 1 <= self.tree <= 8:
            raise QuickdraftError("{tree} must be 1 (chains alone) to 8 candidates at a position", "tree")
        if self.draft_window is not None and self.draft_window < 0:
            raise QuickdraftError("{draft_window} must be 0 (the whole context) or a number of tokens, e.g. 512",
                                  "draft_window")
        if self.draft_history < 0:
            raise QuickdraftError("{draft_history} must be 0 (keep no earlier answers) or a number of tokens, e.g. "
                                  "16384", "draft_history")
        if self.draft_vocab < 0:
            raise QuickdraftError("{draft_vocab} must be 0 (the whole vocabulary) or a number of ids, e.g. 32768",
                                  "draft_vocab")


@dataclass(frozen=True)
class EngineConfig:
    """Where and how a model runs."""

    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    weights: str = "auto"  # auto | bf16 (the dtype's) | int8 | int4 | mixed (weight-only, CPU)
    max_context: int | None = None  # None: the model's own (load() fits it to memory: api.fit_context), capped at
    #                                 DEFAULT_MAX_CONTEXT for a model loaded alone (weights/loader.load_model)
    threads: int | None = None  # CPU threads (None: what this machine's kernels run fastest with: weights/machine.py)
    cuda_graphs: bool = True  # on CUDA, replay decode and verification passes as CUDA graphs (runtime/graphs.py)
    weight_cache: bool = True  # keep quantized conversions on disk for the next load (weights/converted.py)

    def __post_init__(self):
        if self.max_context is not None and self.max_context < 1:
            raise QuickdraftError(f"{{context}} {self.max_context}: give a number of tokens, or leave it out for the "
                                  "model's own context (fitted to memory; 0 on the command line says the same)",
                                  "context")


DEFAULT_MAX_CONTEXT = 4096
