"""The llama / qwen2 / qwen3 decoder as pure tensor math.

No file I/O, no sampling: tokens and a KV cache in, logits out. Loading maps checkpoint names into
these parameter names (quickdraft.weights.names). Which kernel runs each step is decided once, at load
(runtime/plan.py calls `Transformer.plan`): quickdraft's fused CPU kernels (quant/csrc/vnni.cpp, each doing the
arithmetic of the PyTorch code beside it) where they apply, PyTorch's operators otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.runtime.kv_cache import KVCache


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a single row computed as one row of two.

    Kernels pick a different algorithm (a GEMV) for one row than for several, so the same row would get
    slightly different results in a plain step (1 row) and in a verification (k + 1 rows); with oneDNN's
    bf16 GEMM every row's result is otherwise independent of the row count. Padding keeps greedy
    speculative output identical to plain greedy output, for the cost of one extra activation row.
    """
    if x.numel() != x.shape[-1]:
        return F.linear(x, weight, bias)
    return F.linear(x.reshape(1, -1).expand(2, -1), weight, bias)[:1].reshape(*x.shape[:-1], -1)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # quickdraft's rms_norm kernel (plan)

    def plan(self, kernels: bool) -> None:
        self.fused = kernels and self.weight.dtype == torch.bfloat16 and self.weight.shape[-1] % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.quickdraft_vnni.rms_norm(x.contiguous(), self.weight, self.eps)  # the same, fused
        # Normalise in float32, scale in the model dtype (as the reference implementations do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..length-1, each (length, head_dim), float32."""
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**half)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split ("neox") rotation of x (B, H, S, D) by cos/sin (S, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# Passes of up to this many tokens (decode steps, verification rounds) attend row by row, each row exactly
# as a one-token step would: fused attention kernels give a row slightly different results when it is
# computed beside others under a mask, which would make speculative output differ from plain output.
ROWWISE_MAX = 64


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.wqkv = Linear(cfg.dim, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(q_size, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused_qkv = False  # quickdraft's qkv_rotary kernel: split, rotate, transpose (plan)
        self.fused_attention = False  # quickdraft's decode_attention kernel for passes of up to ROWWISE_MAX rows

    def plan(self, kernels: bool) -> None:
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.plan(kernels)
        self.fused_qkv = kernels and self.q_norm is None and self.head_dim % 32 == 0
        # one call for every row of a pass instead of one SDPA call per row
        self.fused_attention = kernels and self.head_dim % 16 == 0 and self.head_dim <= 256

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask) -> torch.Tensor:
        B, S, _ = x.shape
        if self.fused_qkv:
            q, k, v = torch.ops.quickdraft_vnni.qkv_rotary(self.wqkv(x).contiguous(), cos, sin, self.n_heads,
                                                           self.n_kv_heads)
            return self._attend(q, k, v, cache, layer, mask, B, S)
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self._attend(q, k, v, cache, layer, mask, B, S)

    def _attend(self, q, k, v, cache: KVCache, layer: int, mask, B: int, S: int) -> torch.Tensor:
        keys, values = cache.write(layer, k, v)  # (B, Hkv, start + S, D), or (B, Hkv, span, D) at positions
        if mask is None and S <= ROWWISE_MAX and self.fused_attention:  # every row alone, in one call
            out = torch.ops.quickdraft_vnni.decode_attention(q.contiguous(), keys, values, keys.shape[2] - S)
        elif mask is not None or S == 1 or S > ROWWISE_MAX:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        else:
            start = keys.shape[2] - S
            out = torch.cat([
                F.scaled_dot_product_attention(q[:, :, i:i + 1], keys[:, :, :start + i + 1],
                                               values[:, :, :start + i + 1], enable_gqa=True)
                for i in range(S)
            ], dim=2)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.fused = False  # quickdraft's silu_mul kernel (plan)

    def plan(self, kernels: bool) -> None:
        self.fused = kernels and (2 * self.w2.in_features) % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w13(x)
        if self.fused:
            return self.w2(torch.ops.quickdraft_vnni.silu_mul(gate_up.contiguous()))  # the same, fused
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        # Decode and verification passes run the whole layer as one C++ call (block_step) where this holds its
        # operands: the same kernels in the same order as the modules, without their dispatches (plan).
        self.step: tuple | None = None

    def plan(self, kernels: bool, fused: bool = True) -> None:
        for module in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            module.plan(kernels)
        self.step = self._step_operands() if kernels and fused else None

    def _step_operands(self) -> tuple | None:
        """(weights, kinds) as block_step takes them, where it can run this layer: every linear layer offers its
        operands (quickdraft's int8/int4 kernels), no q/k norms, shapes its steps take; else None."""
        a, f, norms = self.attention, self.feed_forward, (self.attention_norm, self.ffn_norm)
        parts = [getattr(m, "fused_operands", lambda: None)() for m in (a.wqkv, a.wo, f.w13, f.w2)]
        if any(p is None for p in parts) or not (
                a.q_norm is None and a.head_dim % 32 == 0 and a.head_dim <= 256 and f.w2.in_features % 16 == 0
                and self.attention_norm.eps == self.ffn_norm.eps
                and all(n.weight.dtype == torch.bfloat16 and n.weight.numel() % 16 == 0 for n in norms)):
            return None
        return [n.weight for n in norms] + [t for operands, _ in parts for t in operands], [kind for _, kind in parts]

    def forward(self, x, cos, sin, cache, layer, mask):
        if self.step is not None and mask is None and x.shape[1] <= ROWWISE_MAX:
            a = self.attention
            return torch.ops.quickdraft_vnni.block_step(x, self.step[0], self.step[1], self.attention_norm.eps, cos,
                                                        sin, a.n_heads, a.n_kv_heads, cache.k[layer], cache.v[layer],
                                                        cache.length)
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_context: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg, max_context or cfg.max_context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def max_context(self) -> int:
        return self.rope_cos.shape[0]

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding table may be quantized: see quant/embedding.py)."""
        return self.norm.weight.dtype

    def plan(self, kernels: bool, fused_layers: bool = True) -> dict:
        """Choose each step's kernel once: quickdraft's CPU kernels where `kernels` (the caller knows they run here:
        runtime/plan.py), each decoder layer as one call where `fused_layers` and its parts allow. Returns how many
        layers run fused."""
        for block in self.layers:
            block.plan(kernels, fused_layers)
        self.norm.plan(kernels)
        return {"layers": len(self.layers), "fused_layers": sum(b.step is not None for b in self.layers)}

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Run tokens (B, S) at positions cache.length .. cache.length + S - 1.

        Writes their keys and values into the cache and advances cache.length by S.
        Returns float32 logits (B, S, V), or (B, 1, V) for the last position when last_only.
        """
        S = tokens.shape[1]
        start, end = cache.length, cache.length + S
        if end > min(cache.capacity, self.max_context):
            raise ValueError(f"positions up to {end} exceed the context of {cache.capacity}")
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        mask = None
        if S > ROWWISE_MAX:  # query i (at position start + i) sees keys 0 .. start + i
            mask = torch.ones(S, end, dtype=torch.bool, device=tokens.device).tril(diagonal=start)
        logits = self._run(tokens, cos, sin, cache, mask, last_only)
        cache.length = end
        return logits

    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, span: int,
                   last_only: bool = False) -> torch.Tensor:
        """forward with shapes that do not depend on where the pass is, for a CUDA graph to capture once
        and replay at any position: tokens (B, S) at positions (S,) (a tensor on the model's device), each
        attending to the cache's first `span` positions up to its own (masked). Writes the keys and values
        at those positions; leaves cache.length to the caller."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = torch.arange(span, device=positions.device)[None, :] <= positions[:, None]  # (S, span)
        return self._run(tokens, cos, sin, cache.at(positions, span), mask, last_only)

    def _run(self, tokens, cos, sin, cache, mask, last_only: bool) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        logits = linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        return logits.float()
