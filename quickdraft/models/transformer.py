"""The decoder of every family quickdraft runs, as pure tensor math: llama (Llama 2/3, TinyLlama), mistral, qwen2,
qwen3, phi3, gemma2, gemma3, gemma4, told apart by their ModelConfig's fields alone.

No file I/O, no sampling: tokens and a KV cache in, logits out. Loading maps checkpoint names into these parameter
names (quickdraft.weights.names). Which kernel runs each step is decided once, at load (runtime/plan.py calls
`Transformer.plan`): quickdraft's fused CPU kernels (quant/csrc/kernels.cpp, each doing the arithmetic of the
PyTorch code beside it) where they apply, PyTorch's operators otherwise.

What varies by family: the FFN's activation (SiLU or tanh GELU), norms around attention and the FFN too
("sandwich", gemma), q/k norms, the attention scale and soft-capping, sliding-window layers with their own
rotary, partial rotary (phi), and gemma4's extras (values from the keys, weightless value norm, layers sharing
the keys and values of an earlier one, per-layer embeddings, a scalar per layer).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models import rope as ropes
from quickdraft.quant import avx2, vnni
from quickdraft.quant.gpu import ROW_TILE
from quickdraft.runtime.kv_cache import KVCache, RecurrentState, Segments, TreeRows


CPU_ROW_BLOCK = 32  # the most rows of one oneDNN bf16 GEMM call (linear)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a single row computed as one row of two (on CUDA: short passes as ROW_TILE rows).

    Kernels pick a different algorithm (a GEMV) for one row than for several, so the same row would get
    slightly different results in a plain step (1 row) and in a verification (k + 1 rows); oneDNN's bf16 GEMM gives
    a row the same result in any pass of 2 to 32 rows (and another in a pass of more, for wide layers), so longer
    passes (a prefill chunk, a batch) run in blocks of CPU_ROW_BLOCK rows. Padding keeps greedy
    speculative output identical to plain greedy output, for the cost of one extra activation row. cuBLAS
    chooses its algorithm by the row count at every size, so on CUDA every pass of fewer than ROW_TILE rows (a
    mixture of experts' share of a pass, say) is computed as ROW_TILE rows. In float32 on the CPU, where MKL's
    GEMM orders its sums by the row and thread counts, quickdraft's own kernel runs it (quant/avx2.py), each output
    summed in one fixed order.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.is_cuda and avx2.available():
        return torch.ops.quickdraft_avx2.linear_f32(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if x.is_cuda:
        if rows >= ROW_TILE:
            return F.linear(x, weight, bias)
        padded = F.pad(x.reshape(rows, -1), (0, 0, 0, ROW_TILE - rows))
        return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], -1)
    if rows == 1:
        return F.linear(x.reshape(1, -1).expand(2, -1), weight, bias)[:1].reshape(*x.shape[:-1], -1)
    if rows <= CPU_ROW_BLOCK:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, -1)
    blocks = [F.linear(flat[i:i + CPU_ROW_BLOCK], weight, bias) for i in range(0, rows, CPU_ROW_BLOCK)]
    return torch.cat(blocks).reshape(*x.shape[:-1], -1)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """x / rms(x) * w (gemma's 1 + w is folded into w at load)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = False  # quickdraft's rms_norm kernel (plan)

    def plan(self, kernels: bool) -> None:
        self.fused = kernels and self.weight.dtype == torch.bfloat16 and self.weight.shape[-1] % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return vnni.ops().rms_norm(x.contiguous(), self.weight, self.eps)  # the same, fused
        # Normalise in float32, scale in the model dtype (as the reference implementations do).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def unit_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (gemma4's values)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_tables(cfg: ModelConfig, length: int, kind: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of a kind of layer ("full" or "sliding") for positions 0..length-1, each (length, rotated
    dims), float32."""
    index = next((i for i in range(cfg.n_layers) if cfg.layer_kind(i) == kind), 0)
    return ropes.tables(cfg.rope_of(index), cfg.head_dim_of(index), length)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split ("neox") rotation of x (B, H, S, D) by cos/sin (S, R): the first R dims rotate (R < D: partial
    rotary), the rest pass through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# Passes of up to this many tokens (decode steps, verification rounds) attend row by row, each row exactly
# as a one-token step would: fused attention kernels give a row slightly different results when it is
# computed beside others under a mask, which would make speculative output differ from plain output.
ROWWISE_MAX = 64


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads_of(index), cfg.head_dim_of(index)
        self.kind = cfg.layer_kind(index)
        self.window = cfg.sliding_window if self.kind == "sliding" else None
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim ** -0.5
        self.softcap, self.eps = cfg.attn_softcap, cfg.norm_eps
        self.source = cfg.kv_source(index)  # the layer whose keys and values it attends to
        # gemma4's last layers: an earlier layer's keys and values; a Gemma 4 assistant's: its target's (the cache
        # it is given maps the layer to the target's: models/assistant.py)
        self.shares = self.source != index or cfg.assistant_backbone > 0
        self.values_from_keys = cfg.k_eq_v and self.kind == "full"
        self.v_norm = cfg.v_norm
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.gated = cfg.attn_output_gate  # qwen3.5: wq gives each head's query and its output gate, side by side
        self.parts = ("wq",) if self.shares else ("wq", "wk") if self.values_from_keys else ("wq", "wk", "wv")
        self.split = (q_size * (2 if self.gated else 1), kv_size, kv_size)[:len(self.parts)]
        self.wqkv = Linear(cfg.dim, sum(self.split), bias=cfg.qkv_bias)  # the projections the layer has, fused
        self.wo = Linear(q_size, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm and not self.shares else None
        self.fused_qkv = False  # quickdraft's qkv_rotary kernel: split, rotate, transpose (plan)
        self.fused_attention = False  # quickdraft's decode_attention kernel for passes of up to ROWWISE_MAX rows

    def plain(self) -> bool:
        """Projections, rotary and attention as llama's: what the fused kernels implement."""
        return (self.q_norm is None and len(self.parts) == 3 and not self.v_norm and self.softcap is None
                and self.scale == self.head_dim ** -0.5 and not self.gated)

    def plan(self, kernels: bool, rotary: int) -> None:
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.plan(kernels)
        self.fused_qkv = kernels and self.plain() and rotary == self.head_dim and self.head_dim % 32 == 0
        # one call for every row of a pass instead of one SDPA call per row
        self.fused_attention = (kernels and self.softcap is None and self.head_dim % 16 == 0
                                and self.head_dim <= 256)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask, rows: int | None = None) -> torch.Tensor:
        """rows: the pass's first `rows` positions are real, the rest padding (LoadedModel.forward on CUDA), which
        nothing real attends to: their attention is not computed."""
        B, S, _ = x.shape
        if self.fused_qkv:
            q, k, v = vnni.ops().qkv_rotary(self.wqkv(x).contiguous(), cos, sin, self.n_heads,
                                                           self.n_kv_heads)
            return self._attend(q, k, v, cache, layer, mask, B, S, rows=rows)
        parts = self.wqkv(x).split(self.split, dim=-1)
        gate = None
        if self.gated:
            q, gate = parts[0].view(B, S, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = parts[0].view(B, S, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # (B, H, S, D)
        if len(parts) == 1:  # keys and values of an earlier layer (gemma4's shared layers)
            return self._attend(q, None, None, cache, layer, mask, B, S, gate, rows)
        k = parts[1].view(B, S, self.n_kv_heads, self.head_dim)
        v = parts[2].view(B, S, self.n_kv_heads, self.head_dim) if len(parts) == 3 else k  # gemma4: values = keys
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm:
            v = unit_norm(v, self.eps)
        k, v = apply_rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
        return self._attend(q, k, v, cache, layer, mask, B, S, gate, rows)

    def _attend(self, q, k, v, cache: KVCache | Segments, layer: int, mask, B: int, S: int, gate=None,
                rows: int | None = None) -> torch.Tensor:
        if isinstance(cache, TreeRows):  # a tree's rows: each over its own path (TreeRows.attend)
            out = cache.attend(self, q, k, v, layer)
        elif isinstance(cache, Segments):  # each sequence's rows over its own cache, as its own pass would (a tree's
            parts = [cache.split(t, 2) if t is not None else [None] * len(cache.sizes) for t in (q, k, v)]
            out = torch.cat([c.attend(self, *qkv, layer) if isinstance(c, TreeRows) else  # as forward_tree's)
                             self._attention(*qkv, c, layer, None, n, None) for *qkv, c, n in
                             zip(*parts, cache.caches, cache.sizes)], dim=2)
        else:
            out = self._attention(q, k, v, cache, layer, mask, S, rows)
        out = out.transpose(1, 2).reshape(B, S, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(B, S, -1))
        return self.wo(out)

    def _attention(self, q, k, v, cache: KVCache, layer: int, mask, S: int, rows: int | None) -> torch.Tensor:
        """Attention of the pass's S rows (B, H, S, D) over the cache, their keys and values written into it."""
        if k is None:
            keys, values = cache.read(self.source, S)
        else:
            keys, values = cache.write(layer, k, v)  # (B, Hkv, start + S, D), or (B, Hkv, span, D) at positions
        start = keys.shape[2] - S
        if mask is None and S <= ROWWISE_MAX and self.fused_attention:  # every row alone, in one call
            scaled = q if self.scale == self.head_dim ** -0.5 else q * (self.scale * self.head_dim ** 0.5)
            out = vnni.ops().decode_attention(scaled.contiguous(), keys, values, start,
                                                             self.window or 0)
        elif self.softcap is not None:
            out = self._capped(q, keys, values, mask, start)
        elif mask is not None or (S == 1 and not self._windowed(start + S)) or S > ROWWISE_MAX:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=self.scale)
        else:
            out = torch.cat([self._row(q[:, :, i:i + 1], keys, values, start + i + 1) for i in range(rows or S)], dim=2)
            out = F.pad(out, (0, 0, 0, S - out.shape[2]))  # padding rows: zeros
        return out

    def _windowed(self, end: int) -> bool:
        return self.window is not None and end > self.window

    def _row(self, q, keys, values, end: int) -> torch.Tensor:
        """One query row at position end - 1, alone, over the keys it sees."""
        lo = max(0, end - self.window) if self.window else 0
        return F.scaled_dot_product_attention(q, keys[:, :, lo:end], values[:, :, lo:end], enable_gqa=True,
                                              scale=self.scale)

    def _capped(self, q, keys, values, mask, start: int) -> torch.Tensor:
        """Attention with soft-capped logits (gemma2): cap tanh(logits / cap), in float32; row by row for short
        passes (batch invariance), under the mask otherwise."""
        groups = self.n_heads // keys.shape[1]
        k, v = keys.repeat_interleave(groups, 1).float(), values.repeat_interleave(groups, 1).float()
        S = q.shape[2]
        if mask is None:
            positions = torch.arange(start, start + S, device=q.device)[:, None]
            span = torch.arange(keys.shape[2], device=q.device)[None, :]
            mask = (span <= positions) & ((span > positions - self.window) if self.window else True)
            rows = [self._capped_rows(q[:, :, i:i + 1], k, v, mask[i:i + 1]) for i in range(S)]
            return torch.cat(rows, dim=2)
        return self._capped_rows(q, k, v, mask)

    def _capped_rows(self, q, k, v, mask) -> torch.Tensor:
        scores = q.float() @ k.transpose(-1, -2) * self.scale
        scores = self.softcap * torch.tanh(scores / self.softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).to(q.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet linear-attention layer (qwen3.5's "linear_attention"): projections to q, k, v (through a
    short causal depthwise convolution and SiLU), an output gate z, a write strength beta and a decay g per
    value head; the delta rule updates a (key size x value size) state per head,

        S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t,

    with q and k L2-normalised (q also by 1 / sqrt(key size)); o is RMS-normed per head, times SiLU(z), and projected
    back. Passes of up to ROWWISE_MAX tokens (decode steps, verification rounds) run the recurrence token by token,
    the same arithmetic for a token whatever the pass, and save the state after each token in the cache's
    RecurrentState (so a rollback restores exactly what plain decoding has); longer passes (a prefill) run the
    chunked form, which gives the same outputs in matrix products over chunks of CHUNK tokens.
    """

    CHUNK = 64

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.kind = "linear"
        self.n_kv_heads, self.head_dim, self.source = 0, 0, index  # no keys and values in the KV cache
        self.k_heads, self.v_heads = cfg.linear_k_heads, cfg.linear_v_heads
        self.k_dim, self.v_dim = cfg.linear_k_dim, cfg.linear_v_dim
        self.v_tiled = cfg.linear_v_tiled
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim, self.kernel = 2 * self.key_size + self.value_size, cfg.linear_conv
        self.in_qkv = Linear(cfg.dim, self.conv_dim, bias=False)
        self.in_z = Linear(cfg.dim, self.value_size, bias=False)
        self.in_b = Linear(cfg.dim, self.v_heads, bias=False)
        self.in_a = Linear(cfg.dim, self.v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel))  # depthwise, as checkpoints hold it
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.out_norm = RMSNorm(self.v_dim, cfg.norm_eps)
        self.wo = Linear(self.value_size, cfg.dim, bias=False)

    def state_shape(self) -> tuple[int, int, int, int, int]:
        return self.conv_dim, self.kernel, self.v_heads, self.k_dim, self.v_dim

    def plain(self) -> bool:
        return False

    fused_step = False  # quickdraft's gated_delta_step kernel for the recurrence (plan)

    def plan(self, kernels: bool, rotary: int) -> None:
        self.out_norm.plan(kernels)
        self.fused_step = kernels

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask, rows: int | None = None) -> torch.Tensor:
        """rows: the pass's first `rows` positions are real, the rest padding (LoadedModel.forward on CUDA): the
        recurrence runs over the real ones only, and the state is saved after each of them."""
        B, S, _ = x.shape
        mixed = self.in_qkv(x)  # (B, S, C)
        b, a = self.in_b(x), self.in_a(x)  # (B, S, Hv): beta = sigmoid(b), g = -exp(A) softplus(a + dt_bias)
        if isinstance(cache, Segments):  # each sequence's rows through its own recurrent state (a tree's as
            out = torch.cat([c.mix(self, *parts, layer) if isinstance(c, TreeRows) else  # forward_tree's)
                             self._mix(*parts, c.states[layer], c.length, None) for *parts, c in
                             zip(cache.split(mixed, 1), cache.split(b, 1), cache.split(a, 1), cache.caches)], dim=2)
        elif isinstance(cache, TreeRows):  # the chain through the state, each leaf from the state after its parent
            out = cache.mix(self, mixed, b, a, layer)
        else:
            out = self._mix(mixed, b, a, cache.states[layer], cache.length, rows)
        out = out.transpose(1, 2)  # (B, S, Hv, Dv)
        z = self.in_z(x).view(B, S, self.v_heads, self.v_dim)
        h = (self.out_norm(out.to(x.dtype)).float() * F.silu(z.float())).to(x.dtype)
        return self.wo(h.reshape(B, S, self.value_size))

    def _mix(self, mixed, b, a, state: RecurrentState, start: int, rows: int | None) -> torch.Tensor:
        """The convolution and the recurrence over one sequence's S rows from its state at `start`: (B, Hv, S, Dv)."""
        B, S, _ = mixed.shape
        window = torch.cat([state.conv, mixed.to(state.conv.dtype)], dim=1)  # (B, K - 1 + S, C)
        w = self.conv_weight.float()[:, 0]  # (C, K)
        conv = sum(window[:, j:j + S].float() * w[:, j] for j in range(self.kernel))  # each position alone
        conv = F.silu(conv).to(mixed.dtype)
        q, k, v = conv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = self._per_value_head(_l2norm(q.float().view(B, S, self.k_heads, self.k_dim))) * self.k_dim ** -0.5
        k = self._per_value_head(_l2norm(k.float().view(B, S, self.k_heads, self.k_dim)))
        v = v.float().view(B, S, self.v_heads, self.v_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, Hv, S, D)
        if S <= ROWWISE_MAX:
            out = self._recurrent(q, k, v, b, a, state, window, start, rows or S)
        else:
            beta, g = self._gates(b, a)
            out, ssm = self._chunked(q, k, v, beta.transpose(1, 2), g.transpose(1, 2), state.ssm)
            index, slot = state.fresh()
            slot.copy_(ssm)
            state.save(start + S, window[:, -(self.kernel - 1):], index)
        state.trim(start + (rows or S))
        return out

    def _per_value_head(self, t: torch.Tensor) -> torch.Tensor:
        """(B, S, key heads, D) -> (B, S, value heads, D): each value head's key head, in the checkpoint's order of
        value heads (transformers' grouped order, or the tiled order of llama.cpp's GGUF files)."""
        groups = self.v_heads // self.k_heads
        return t.repeat(1, 1, groups, 1) if self.v_tiled else t.repeat_interleave(groups, 2)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) and the log decay g = -exp(A) softplus(a + dt_bias), in float32."""
        beta = torch.sigmoid(b).float()
        return beta, -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _recurrent(self, q, k, v, b, a, state, window, start: int, rows: int) -> torch.Tensor:
        """Token by token, over the first `rows` tokens (the rest, padding, give zeros). Each token's gates are
        computed on its own row too: PyTorch's vectorised elementwise kernels leave a tensor's tail to scalar code,
        so a value's rounding could otherwise depend on how many tokens the pass holds."""
        ssm, outs = state.ssm, []
        for t in range(rows):
            beta, g = self._gates(b[:, t].contiguous(), a[:, t].contiguous())  # (B, Hv)
            decay = g.exp()
            index, slot = state.fresh()
            if self.fused_step:  # the same recurrence in one C++ call (quant/csrc/kernels.cpp)
                outs.append(vnni.ops().gated_delta_step(
                    ssm, q[:, :, t].contiguous(), k[:, :, t].contiguous(), v[:, :, t].contiguous(), decay, beta,
                    slot))
            else:
                decayed = ssm * decay[..., None, None]
                k_t = k[:, :, t]
                delta = (v[:, :, t] - (decayed * k_t[..., None]).sum(-2)) * beta[..., None]
                torch.add(decayed, k_t[..., None] * delta[..., None, :], out=slot)
                outs.append((slot * q[:, :, t][..., None]).sum(-2))
            state.save(start + t + 1, window[:, t + 1:t + self.kernel], index)
            ssm = slot
        out = torch.stack(outs, dim=2)
        return F.pad(out, (0, 0, 0, q.shape[2] - rows)) if rows < q.shape[2] else out

    def _chunked(self, q, k, v, beta, g, ssm):
        """The same recurrence over chunks of C tokens, in matrix products. Within a chunk with decay products
        G_t = exp(g_1 + ... + g_t): the updates U solve (I + A) U = beta V - (beta G K) S0 with A[t, s] =
        beta_t (G_t / G_s) k_t . k_s for s < t; the outputs are O = (G Q) S0 + ((Q K^T) * D) U with D[t, s] = G_t /
        G_s for s <= t; the state after it is G_C S0 + (K G_C / G)^T U."""
        B, H, S, _ = q.shape
        C = self.CHUNK
        pad = (-S) % C
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
        n = (S + pad) // C
        q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))
        beta, g = beta.reshape(B, H, n, C), g.reshape(B, H, n, C)
        cum = g.cumsum(-1)  # log G_t within each chunk
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D[t, s]
        kb = k * beta[..., None]
        a = (kb @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unit triangular
        solve = lambda rhs: torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # noqa: E731
        w_new = solve(v * beta[..., None])  # (I + A)^-1 beta V
        k_decayed = solve(kb * cum.exp()[..., None])  # (I + A)^-1 beta G K
        attn = (q @ k.transpose(-1, -2)) * decay
        q_decayed = q * cum.exp()[..., None]
        k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
        outs = []
        for i in range(n):
            u = w_new[:, :, i] - k_decayed[:, :, i] @ ssm
            outs.append(q_decayed[:, :, i] @ ssm + attn[:, :, i] @ u)
            ssm = ssm * cum[:, :, i, -1].exp()[..., None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
        out = torch.cat(outs, dim=2)[:, :, :S]
        return out, ssm


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, ffn_dim: int | None = None):
        super().__init__()
        ffn_dim = ffn_dim or cfg.ffn_dim_of(index)
        self.activation = cfg.activation
        self.w13 = Linear(cfg.dim, 2 * ffn_dim, bias=False)  # gate and up, fused
        self.w2 = Linear(ffn_dim, cfg.dim, bias=False)
        self.fused = False  # quickdraft's silu_mul kernel (plan)

    def plan(self, kernels: bool) -> None:
        self.fused = kernels and self.activation == "silu" and (2 * self.w2.in_features) % 32 == 0

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        gate_up = self.w13(x)
        if self.fused:
            return self.w2(vnni.ops().silu_mul(gate_up.contiguous()))  # the same, fused
        # the same in one fixed order, whatever the threads' split (quant/avx2.py)
        if not gate_up.is_cuda and gate_up.dtype != torch.float16 and avx2.available():
            return self.w2(torch.ops.quickdraft_avx2.act_mul(gate_up.contiguous(), avx2.ACTIVATIONS[self.activation]))
        gate, up = gate_up.chunk(2, dim=-1)
        active = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(active * up)


class MoE(nn.Module):
    """A mixture-of-experts FFN (qwen3_moe, qwen3_5_moe): the router's softmax over n_experts picks each token's top
    experts_per_token (renormalised where norm_topk), each a SwiGLU FeedForward on the quantized formats like any
    other; their weighted outputs are added expert by expert in the experts' order, as transformers does, plus a
    shared expert times sigmoid(its gate) where the model has one.

    Batch invariance: an expert computes the rows routed to it together, and every linear layer here gives a row the
    same result whatever the rows beside it (models/transformer.linear, the quantized kernels); each token's sum
    runs over its own experts in the same order in every pass. So a token's output does not depend on how many tokens
    were verified with it. The router stays in the model's dtype (not quantized): it decides which experts run."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg, index, cfg.expert_ffn_dim) for _ in range(cfg.n_experts))
        shared = cfg.shared_expert_ffn_dim
        self.shared = FeedForward(cfg, index, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if shared else None

    def plan(self, kernels: bool) -> None:
        for expert in [*self.experts, *([self.shared] if self.shared is not None else [])]:
            expert.plan(kernels)

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """rows: the first `rows` positions are real, the rest padding (LoadedModel.forward on CUDA): only the real
        ones are routed (padding rows get the shared expert alone)."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = linear(h, self.router.weight)
        top, chosen = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(logits.dtype)
        out = torch.zeros_like(h)
        if rows is not None:
            chosen = chosen[:rows]
        for e in torch.unique(chosen).tolist():  # ascending: every token's experts in the same order
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](h[rows]) * top[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared is not None:
            gate = linear(h, self.shared_gate.weight)  # (N, 1): each row on its own in short passes (as a
            #   GatedDeltaNet's gates: the scalar tail of a vectorised kernel would round a row by the pass's size)
            gate = torch.cat([torch.sigmoid(r) for r in gate.split(1)]) if len(gate) <= ROWWISE_MAX else gate.sigmoid()
            out = out + gate * self.shared(h)
        return out.reshape(shape)


# What block_step (csrc/kernels.cpp) computes is a llama-shaped layer: the config fields it follows. A layer runs it
# only where its config sets nothing else (every other field at its default): a whitelist, so a family's new feature
# runs the modules until the C++ step learns it. (rope: where its rotary covers whole heads, checked at plan;
# layer_types: where this layer is a full-attention one; mtp_layers and dense_layers describe other layers.)
FUSED_FIELDS = frozenset({"arch", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                          "norm_eps", "rope_theta", "max_context", "qkv_bias", "tie_embeddings", "rope", "layer_types",
                          "mtp_layers", "dense_layers"})


def fused_step_follows(cfg: ModelConfig, index: int) -> bool:
    """Whether layer `index` of cfg is what block_step computes (FUSED_FIELDS)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    return cfg.layer_kind(index) == "full" and all(getattr(cfg, name) == default for name, default in defaults.items()
                                                   if name not in FUSED_FIELDS)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.fusable = fused_step_follows(cfg, index)  # block_step may run it (plan: where the kernels also apply)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = GatedDeltaNet(cfg, index) if cfg.layer_kind(index) == "linear" else Attention(cfg, index)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg, index) if cfg.is_moe(index) else FeedForward(cfg, index)
        sandwich = cfg.sandwich_norms
        self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None
        if cfg.ple_dim:  # gemma4's per-layer embedding input
            self.ple_gate = Linear(cfg.dim, cfg.ple_dim, bias=False)
            self.ple_proj = Linear(cfg.ple_dim, cfg.dim, bias=False)
            self.ple_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalar else None
        # Decode and verification passes run the whole layer as one C++ call (block_step) where this holds its
        # operands: the same kernels in the same order as the modules, without their dispatches (plan).
        self.step: tuple | None = None

    def norms(self) -> list[RMSNorm]:
        return [n for n in (self.attention_norm, self.ffn_norm, self.post_attention_norm, self.post_ffn_norm,
                            getattr(self, "ple_norm", None)) if n is not None]

    def plan(self, kernels: bool, fused: bool, rotary: int) -> None:
        for norm in self.norms():
            norm.plan(kernels)
        self.attention.plan(kernels, rotary)
        self.feed_forward.plan(kernels)
        self.step = self._step_operands(rotary) if kernels and fused else None

    def _step_operands(self, rotary: int) -> tuple | None:
        """(weights, kinds) as block_step takes them, where it can run this layer: its config is what the step
        computes (fusable: FUSED_FIELDS), its rotary covers whole heads, and its linear layers all offer their
        operands (quickdraft's int8/int4 kernels) in shapes the step takes; else None."""
        a, f, norms = self.attention, self.feed_forward, (self.attention_norm, self.ffn_norm)
        if not self.fusable or rotary != a.head_dim:
            return None
        parts = [getattr(m, "fused_operands", lambda: None)() for m in (a.wqkv, a.wo, f.w13, f.w2)]
        if any(p is None for p in parts) or not (
                a.head_dim % 32 == 0 and a.head_dim <= 256 and f.w2.in_features % 16 == 0
                and all(n.weight.dtype == torch.bfloat16 and n.weight.numel() % 16 == 0 for n in norms)):
            return None
        return [n.weight for n in norms] + [t for operands, _ in parts for t in operands], [kind for _, kind in parts]

    def forward(self, x, cos, sin, cache, layer, mask, ple=None, rows: int | None = None):
        if self.step is not None and mask is None and x.shape[1] <= ROWWISE_MAX and isinstance(cache, KVCache):
            a = self.attention
            return vnni.ops().block_step(x, self.step[0], self.step[1], self.attention_norm.eps, cos,
                                                        sin, a.n_heads, a.n_kv_heads, cache.k[layer], cache.v[layer],
                                                        cache.length)
        h = self.attention(self.attention_norm(x), cos, sin, cache, layer, mask, rows)
        x = x + (self.post_attention_norm(h) if self.post_attention_norm is not None else h)
        h = self.feed_forward(self.ffn_norm(x), rows)
        x = x + (self.post_ffn_norm(h) if self.post_ffn_norm is not None else h)
        if ple is not None:
            x = x + self.ple_norm(self.ple_proj(F.gelu(self.ple_gate(x), approximate="tanh") * ple))
        if self.layer_scalar is not None:
            x = x * self.layer_scalar.to(x.dtype)
        return x


class MTP(nn.Module):
    """Qwen3.5's multi-token-prediction block (the `mtp` drafter, speculative/mtp.py): from a position's hidden state h
    (the target's, after its final norm) and the embedding e of the token that follows it, a full-attention decoder
    layer over fc([enorm(e), hnorm(h)]) gives a hidden state (after its own norm) whose logits, through the target's
    head, guess the token after that, and which feeds the next step in a chain. As llama.cpp's and vLLM's MTP run it.
    Its keys and values live in a cache of its own (one layer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        extended = cfg.replace(n_layers=cfg.n_layers + 1, layer_types=(*(cfg.layer_types or ()), "full")
                               if cfg.layer_types else None, kv_shared_layers=0)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.fc = Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.layer = Block(extended, cfg.n_layers)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def kv_layout(self) -> list[tuple[int, int, int]]:
        return [(self.layer.attention.n_kv_heads, self.layer.attention.head_dim, 0)]

    def plan(self, kernels: bool, rotary: int) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.plan(kernels)
        self.layer.plan(kernels, False, rotary)


class Decoder(nn.Module):
    """What the models here share (Transformer, models/assistant.Assistant): rotary tables per kind of layer (the
    subclass sets `cfg` and `kinds`), the device and the activations' dtype (from its final norm, `norm`)."""

    def set_rotary(self, length: int, device=None) -> None:
        """The rotary tables (float32) for positions 0..length - 1, one pair per kind of layer."""
        for kind in self.kinds:
            cos, sin = (t.to(device) if device is not None else t for t in rotary_tables(self.cfg, length, kind))
            self.register_buffer(f"rope_cos_{kind}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{kind}", sin, persistent=False)

    def _tables(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"rope_cos_{kind}"), getattr(self, f"rope_sin_{kind}")

    @property
    def max_context(self) -> int:
        return self._tables(self.kinds[0])[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding table may be quantized: see quant/embedding.py)."""
        return self.norm.weight.dtype


class Transformer(Decoder):
    def __init__(self, cfg: ModelConfig, max_context: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.ple_dim:  # gemma4: per-layer embeddings, from a table and from the embeddings' projection
            self.ple_embeddings = nn.Embedding(cfg.ple_vocab, cfg.n_layers * cfg.ple_dim)
            self.ple_model_proj = Linear(cfg.dim, cfg.n_layers * cfg.ple_dim, bias=False)
            self.ple_proj_norm = RMSNorm(cfg.ple_dim, cfg.norm_eps)
        self.mtp = MTP(cfg) if cfg.mtp_layers else None
        self.kinds = sorted({cfg.layer_kind(i) for i in range(cfg.n_layers)} | ({"full"} if cfg.mtp_layers else set()))
        self.set_rotary(max_context or cfg.max_context)

    @property
    def rope_cos(self) -> torch.Tensor:
        return getattr(self, f"rope_cos_{self.kinds[0]}")

    def kv_layout(self) -> list[tuple[int, int, int]]:
        """Per layer: (key/value heads, head size, the layer whose cache it uses); 0 heads for a linear layer."""
        return [(b.attention.n_kv_heads, b.attention.head_dim, b.attention.source) for b in self.layers]

    def state_layout(self) -> list | None:
        """Per layer: None, or a linear-attention layer's recurrent state shape (KVCache's states); None for a model
        without such layers (its cache then has no recurrent state at all)."""
        shapes = [b.attention.state_shape() if isinstance(b.attention, GatedDeltaNet) else None for b in self.layers]
        return shapes if any(shapes) else None

    @property
    def hybrid(self) -> bool:
        return any(isinstance(b.attention, GatedDeltaNet) for b in self.layers)

    def plan(self, kernels: bool, fused_layers: bool = True) -> dict:
        """Choose each step's kernel once: quickdraft's CPU kernels where `kernels` (the caller knows they run here:
        runtime/plan.py), each decoder layer as one call where `fused_layers` and its parts allow. Returns how many
        layers run fused."""
        for block in self.layers:
            block.plan(kernels, fused_layers, self._tables(block.attention.kind)[0].shape[-1])
        self.norm.plan(kernels)
        if self.mtp is not None:
            self.mtp.plan(kernels, self._tables("full")[0].shape[-1])
        if hasattr(self, "ple_proj_norm"):
            self.ple_proj_norm.plan(kernels)
        return {"layers": len(self.layers), "fused_layers": sum(b.step is not None for b in self.layers)}

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False, head=None,
                rows: int | None = None) -> torch.Tensor:
        """Run tokens (B, S) at positions cache.length .. cache.length + S - 1.

        Writes their keys and values into the cache and advances cache.length by S.
        Returns float32 logits (B, S, V), or (B, 1, V) for the last position when last_only; head: what turns the
        normed hidden states into logits instead of the model's own head (a draft's head over part of its
        vocabulary: speculative/subset.py); rows: only the first `rows` tokens are real, the rest padding that
        keeps the pass's shape fixed (LoadedModel.forward): their keys, values and hidden states are written past
        them and mean nothing, and a recurrent state stops after the real ones (the caller rolls back to them).
        """
        S = tokens.shape[1]
        start, end = cache.length, cache.length + S
        first = cache.position  # the positions of a windowed draft's cache run ahead of its indices (compact)
        if end > cache.capacity or first + S > self.max_context:
            raise ValueError(f"positions up to {first + S} exceed the context of {cache.capacity}")
        rotary = {kind: tuple(t[first:first + S] for t in self._tables(kind)) for kind in self.kinds}
        masks = dict.fromkeys(self.kinds)
        if S > ROWWISE_MAX:  # query i (at position start + i) sees keys 0 .. start + i (the window's, if sliding)
            positions = torch.arange(start, end, device=tokens.device)[:, None]
            span = torch.arange(end, device=tokens.device)[None, :]
            masks = {kind: self._mask(kind, positions, span) for kind in self.kinds}
        logits = self._run(tokens, rotary, cache, masks, last_only, head, rows)
        cache.length = end
        return logits

    def forward_segments(self, feeds: list[torch.Tensor], caches: list[KVCache], last_only: list[bool],
                         trees: list | None = None) -> list[torch.Tensor]:
        """Several sequences' passes as one (continuous batching): feeds[i] (S_i,) at caches[i].length on, each
        cache advanced by its S_i. Every row is computed as the sequence's own pass computes it (the linear layers'
        kernels give a row the same bits whatever rows are beside it; attention and recurrent states run per
        sequence), so the logits are bit for bit those of forward on each alone. trees[i] (depths, chain_rows), where
        not None: that sequence's rows are a tree's, each computed as forward_tree computes it (the caller keeps a
        path with TreeRows.commit). At most ROWWISE_MAX rows in all. Returns per sequence float32 logits (S_i, V),
        or (1, V) of its last row where last_only[i]."""
        sizes = [int(f.shape[0]) for f in feeds]
        if sum(sizes) > ROWWISE_MAX or min(sizes) < 1:
            raise ValueError(f"a batched pass takes 1 to {ROWWISE_MAX} rows per sequence and in all, not {sizes}")
        for cache, n in zip(caches, sizes):
            if cache.length + n > min(cache.capacity, self.max_context):
                raise ValueError(f"positions up to {cache.length + n} exceed the context of {cache.capacity}")
        trees = trees or [None] * len(caches)
        tokens = torch.cat(feeds)[None]
        positions = torch.cat([torch.arange(c.position, c.position + n) if tree is None else
                               torch.tensor([c.position + d for d in tree[0]])
                               for c, n, tree in zip(caches, sizes, trees)])
        positions = positions.to(self._tables(self.kinds[0])[0].device)
        rotary = {kind: tuple(t[positions] for t in self._tables(kind)) for kind in self.kinds}
        views = [c if tree is None else TreeRows(c, tree[0], tree[1]) for c, tree in zip(caches, trees)]
        segments = Segments(views, sizes)
        x = self.embed(tokens)
        ple = self._per_layer_inputs(tokens, x) if self.cfg.ple_dim else None
        for i, layer in enumerate(self.layers):
            cos, sin = rotary[layer.attention.kind]
            x = layer(x, cos, sin, segments, i, None, None if ple is None else ple[:, :, i])
            offset = 0
            for cache, n in zip(caches, sizes):
                if i in cache.feature_layers and i < len(self.layers) - 1:  # a drafter reads them (dflash)
                    cache.store_feature(i, x[0, offset:offset + n])
                offset += n
        x = self.norm(x)[0]
        wanted, offset = [], 0
        for cache, n, last in zip(caches, sizes, last_only):
            if len(self.layers) - 1 in cache.feature_layers:  # the last layer's, as transformers gives it: normed
                cache.store_feature(len(self.layers) - 1, x[offset:offset + n])
            if cache.hidden is not None:  # a drafter reads the hidden states (mtp)
                cache.store_hidden(x[offset:offset + n])
            wanted.append(torch.arange(offset + n - 1 if last else offset, offset + n))
            cache.length += n
            offset += n
        for cache, view in zip(caches, views):
            if view is not cache:
                cache.tree = view  # what TreeRows.commit replays of a kept leaf (a recurrent layer's step)
        logits = self.head(x[torch.cat(wanted).to(x.device)][None])[0]
        return list(logits.split([len(w) for w in wanted]))

    def forward_tree(self, tokens: torch.Tensor, depths: list[int], chain_rows: int,
                     cache: KVCache) -> torch.Tensor:
        """A tree's verification pass (tokens (S,)): rows 0 .. chain_rows - 1 a chain from the pending token on (row
        i at position cache.length + i), each further row a leaf whose parent is chain row depths[row] - 1 (at
        position cache.length + depths[row]). Every row is computed as a pass over its own path would compute it (the chain's
        as a chain pass, a leaf's as a one-row step after its parent: TreeRows), so its logits are bit for bit those.
        Writes every row's keys and values (the leaves' after the chain's) and advances cache.length by S; the caller
        keeps a path with TreeRows.commit. Returns float32 logits (S, V)."""
        S = tokens.shape[0]
        if S > ROWWISE_MAX:
            raise ValueError(f"a tree's pass takes at most {ROWWISE_MAX} rows, not {S}")
        start = cache.length
        if start + S > min(cache.capacity, self.max_context):
            raise ValueError(f"positions up to {start + S} exceed the context of {cache.capacity}")
        positions = torch.tensor([start + d for d in depths], device=tokens.device)
        rotary = {kind: tuple(t[positions] for t in self._tables(kind)) for kind in self.kinds}
        rows = TreeRows(cache, depths, chain_rows)
        logits = self._run(tokens[None], rotary, rows, dict.fromkeys(self.kinds), False)
        cache.length = start + S
        cache.tree = rows  # what TreeRows.commit replays of a kept leaf (a recurrent layer's step)
        return logits[0]

    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, span: int,
                   last_only: bool = False) -> torch.Tensor:
        """forward with shapes that do not depend on where the pass is, for a CUDA graph to capture once
        and replay at any position: tokens (B, S) at positions (S,) (a tensor on the model's device), each
        attending to the cache's first `span` positions up to its own (masked). Writes the keys and values
        at those positions; leaves cache.length to the caller."""
        rotary = {kind: tuple(t[positions] for t in self._tables(kind)) for kind in self.kinds}
        keys = torch.arange(span, device=positions.device)[None, :]
        masks = {kind: self._mask(kind, positions[:, None], keys) for kind in self.kinds}  # (S, span)
        return self._run(tokens, rotary, cache.at(positions, span), masks, last_only)

    def _mask(self, kind: str, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        mask = keys <= positions
        window = self.cfg.sliding_window if kind == "sliding" else None
        return mask & (keys > positions - window) if window else mask

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings (scaled where the family scales them)."""
        x = self.tok_embeddings(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def _run(self, tokens, rotary: dict, cache, masks: dict, last_only: bool, head=None,
             rows: int | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        ple = self._per_layer_inputs(tokens, x) if self.cfg.ple_dim else None
        kept = getattr(cache, "feature_layers", None)  # layers whose outputs a drafter reads (dflash)
        for i, layer in enumerate(self.layers):
            cos, sin = rotary[layer.attention.kind]
            x = layer(x, cos, sin, cache, i, masks[layer.attention.kind], None if ple is None else ple[:, :, i], rows)
            if kept and i in kept and i < len(self.layers) - 1:
                cache.store_feature(i, x[0])
        if kept and len(self.layers) - 1 in kept:  # the last layer's, as transformers gives it: normed
            cache.store_feature(len(self.layers) - 1, self.norm(x)[0])
        if getattr(cache, "hidden", None) is not None:  # a drafter reads the hidden states (mtp): every row's, normed
            x = self.norm(x)
            cache.store_hidden(x[0])
            x = x[:, -1:] if last_only else x
        else:
            x = self.norm(x[:, -1:] if last_only else x)
        return (head or self.head)(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states -> float32 logits."""
        logits = linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        if self.cfg.final_softcap:
            logits = self.cfg.final_softcap * torch.tanh(logits.float() / self.cfg.final_softcap)
        return logits.float()

    def mtp_step(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache,
                 last_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block over pairs (hidden (1, S, D) of position p, tokens (1, S) at p + 1), written into its cache
        (`cache`: KVCache(self.mtp.kv_layout())) at p = cache.length...: (float32 logits (1, S, V) guessing the tokens
        at p + 2, of the last position alone where last_only; its hidden states (1, S, D) for a chain's next step)."""
        S = tokens.shape[1]
        start = cache.length
        if start + S + 1 > self.max_context:
            raise ValueError(f"positions up to {start + S + 1} exceed the context of {self.max_context}")
        e = self.embed(tokens)
        m = self.mtp
        x = m.fc(torch.cat([m.enorm(e), m.hnorm(hidden.to(e.dtype))], dim=-1))
        cos, sin = (t[start + 1:start + S + 1] for t in self._tables("full"))  # rotary at the token's position
        mask = None
        if S > ROWWISE_MAX:  # a long catch-up (the prompt's pairs): causal under a mask, as forward's prefill
            positions = torch.arange(start, start + S, device=tokens.device)[:, None]
            mask = self._mask("full", positions, torch.arange(start + S, device=tokens.device)[None, :])
        x = m.layer(x, cos, sin, cache, 0, mask)
        cache.length = start + S
        h = m.norm(x)
        return self.head(h[:, -1:] if last_only else h), h

    def _per_layer_inputs(self, tokens, x) -> torch.Tensor:
        """gemma4: (B, S, L, P) per-layer inputs: the per-layer table's rows (scaled by sqrt(P)) and the
        projection of the scaled embeddings (by 1 / sqrt(dim), normed), averaged (times 1 / sqrt(2))."""
        cfg = self.cfg
        B, S = tokens.shape
        table = self.ple_embeddings(tokens) * torch.tensor(math.sqrt(cfg.ple_dim), dtype=x.dtype)
        projected = self.ple_model_proj(x) * torch.tensor(cfg.dim ** -0.5, dtype=x.dtype)
        projected = self.ple_proj_norm(projected.reshape(B, S, cfg.n_layers, cfg.ple_dim))
        return (projected + table.reshape(B, S, cfg.n_layers, cfg.ple_dim)) * torch.tensor(2 ** -0.5, dtype=x.dtype)
