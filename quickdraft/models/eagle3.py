"""EAGLE-3 drafter heads (vLLM's `speculators` format: Eagle3DraftModel), as tensor math.

An EAGLE-3 head reads the target's hidden states at a few layers (`eagle_aux_hidden_state_layer_ids`, vLLM's
convention: id i is the input of target layer i, the output of layer i - 1) at each committed position p,
concatenated and projected by `fc` (optionally normed first: `norm_before_fc` over the whole, `fc_norm` per layer),
and pairs the result with the embedding of token p + 1. Its first decoder layer takes both side by side: the
embedding normed by `input_layernorm`, the hidden state by `hidden_norm`, their concatenation (2 * dim wide) into
q, k and v; the residual is the hidden state (normed where `norm_before_residual`). Further layers are plain decoder
layers of the config's family (llama, qwen3). The last layer's output, normed, goes through the head's own output
layer over its draft vocabulary (`draft_vocab_size` tokens; `d2t[i]` maps draft id i to target id i + d2t[i]).

Entry p of its cache is the pair at position p. A chain continues from the head's own output: the next entry pairs
the token it drafted with its last layer's output (normed first where `norm_output`), not with the target's states;
those entries are dropped once the target has verified the round. The arithmetic is the reference's
(speculators/models/eagle3, checked in tests/test_eagle3.py against it on random weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import RopeConfig
from quickdraft.models import rope as ropes
from quickdraft.models.dflash import HeadLayers
from quickdraft.models.transformer import Linear, RMSNorm, apply_rotary
from quickdraft.runtime.kv_cache import KVCache

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class Eagle3Config:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope: RopeConfig
    vocab_size: int  # the target's
    draft_vocab: int  # its head's rows (the whole target vocabulary where equal: no d2t)
    aux_layers: tuple[int, ...]  # the config's ids: id i is the output of target layer i - 1
    qk_norm: bool = False  # its layers' RMSNorm on each head of q and k (the layers' family says: qwen3's have it)
    attention_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    layer_types: tuple[str, ...] = ()  # "full" or "sliding" per layer (empty: all full)
    sliding_window: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    own_embedding: bool = True  # the checkpoint holds embed_tokens (else the target's table is read)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs it reads, in order (runtime/kv_cache.KVCache.keep_features)."""
        return tuple(i - 1 for i in self.aux_layers)


class Layer(nn.Module):
    """A decoder layer of the head; the first takes [embedding; hidden state] (first=True)."""

    def __init__(self, cfg: Eagle3Config, index: int):
        super().__init__()
        H, Hkv, D, dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, D
        self.first = index == 0
        self.norm_before_residual = cfg.norm_before_residual
        kind = cfg.layer_types[index] if cfg.layer_types else "full"
        self.window = cfg.sliding_window if kind == "sliding" else None
        width = 2 * dim if self.first else dim
        self.input_layernorm = RMSNorm(dim, cfg.norm_eps)
        self.hidden_norm = RMSNorm(dim, cfg.norm_eps) if self.first else None
        self.post_attention_layernorm = RMSNorm(dim, cfg.norm_eps)
        self.q_proj = Linear(width, H * D, bias=cfg.attention_bias)
        self.k_proj = Linear(width, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = Linear(width, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = Linear(H * D, dim, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else None
        self.gate_proj = Linear(dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.up_proj = Linear(dim, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.ffn_dim, dim, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x, cos, sin, cache: KVCache, index: int, embedded=None) -> torch.Tensor:
        """x (1, S, dim): the hidden states (the first layer's: the pairs' hidden part, embedded their tokens')."""
        if self.first:
            hidden = self.hidden_norm(x)
            residual = hidden if self.norm_before_residual else x
            h = torch.cat([self.input_layernorm(embedded), hidden], dim=-1)
        else:
            residual, h = x, self.input_layernorm(x)
        x = residual + self._attention(h, cos, sin, cache, index)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))

    def _attention(self, x, cos, sin, cache: KVCache, index: int) -> torch.Tensor:
        S, D = x.shape[1], self.head_dim
        q = self.q_proj(x).view(1, S, self.n_heads, D)
        k = self.k_proj(x).view(1, S, self.n_kv_heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(1, S, self.n_kv_heads, D).transpose(1, 2)
        k, v = cache.write(index, k, v)
        mask = None
        if S > 1 or self.window:
            queries = torch.arange(k.shape[2] - S, k.shape[2], device=x.device)[:, None]
            keys = torch.arange(k.shape[2], device=x.device)[None, :]
            mask = keys <= queries
            if self.window:
                mask &= queries - keys < self.window
        repeat = self.n_heads // self.n_kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                             attn_mask=mask, scale=D ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(1, S, -1))


class Eagle3(HeadLayers):
    def __init__(self, cfg: Eagle3Config, max_context: int):
        super().__init__()
        self.cfg = cfg
        n = len(cfg.aux_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim) if cfg.own_embedding else None
        self.input_norm = RMSNorm(n * cfg.dim, cfg.norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(cfg.dim, cfg.norm_eps) for _ in range(n)) if cfg.fc_norm else None
        self.fc = Linear(n * cfg.dim, cfg.dim, bias=False)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.draft_vocab, bias=False)
        # draft id -> target id (the identity where the head covers the whole vocabulary)
        self.register_buffer("target_ids", torch.arange(cfg.draft_vocab), persistent=False)
        cos, sin = ropes.tables(cfg.rope, cfg.head_dim, max_context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def max_context(self) -> int:
        return self.rope_cos.shape[0]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's states (S, n * dim), as the first layer reads them (S, dim): normed as the config says, fc."""
        x = features.to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], -1)
        return self.fc(x)

    def step(self, embedded: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
             last_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (embedded (S, dim) of tokens p + 1, hidden (S, dim): project's rows of the target's states at p, or
        the head's own output at p - 1 in a chain) written into its cache at p = cache.length...: float32 logits over
        its draft vocabulary (S', draft vocab) guessing the tokens at p + 2, of the last pair alone where last_only;
        and what a chain's next pair reads (S, dim)."""
        S, start = embedded.shape[0], cache.length
        if start + S > min(cache.capacity, self.max_context):
            raise ValueError(f"positions up to {start + S} exceed the drafter's context of "
                             f"{min(cache.capacity, self.max_context)}")
        cos, sin = self.rope_cos[start:start + S], self.rope_sin[start:start + S]
        x, e = hidden.to(self.dtype)[None], embedded.to(self.dtype)[None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, e)
        cache.length = start + S
        normed = self.norm(x[0])
        out = normed if self.cfg.norm_output else x[0]
        return self.lm_head(normed[-1:] if last_only else normed).float(), out
