"""DFlash and DFlash2 block drafters (z-lab's `dflash` package: DFlashDraftModel, DFlash2DraftModel), as tensor math.

A DFlash drafter is a few Qwen3-style decoder layers that draft a whole block in one pass. Its context is the
target's own hidden states: the outputs of several target layers (`target_layer_ids`) at each committed position,
concatenated, projected by `fc` and normed (`hidden_norm`). Its queries are a block of B rows at the positions from
the pending token on: the target's raw embedding of the pending token (times `input_embedding_scale`), then B - 1
rows of the embedding of the mask token. Each layer's keys and values are those of the context rows (kept in its own
cache: a context row's keys depend only on the target's hidden state there) and of the block's rows (dropped after
the pass); the block attends to all of them, without a causal mask (a sliding layer: causal within its window). The
block's rows 1 .. B - 1, normed, go through the target's output head (times `output_multiplier`, soft-capped where
the drafter says) and guess the B - 1 tokens after the pending one, all at once.

DFlash2 adds to every layer a grouped dynamic causal convolution over the block's rows before and after attention
and before and after the MLP (`GroupedDynamicCausalConv`), and chooses its tokens with a candidate selector: at each
position the top `selector_top_k` tokens of the head, rescored by a low-rank term that pairs the token chosen before
(the pending token first) with each candidate, so the chain of choices is conditional as a draft model's is.

The arithmetic is the reference's (dflash/model.py, checked in tests/test_dflash.py against it on random weights);
the keys and values of the context live in a KVCache of the drafter's own (speculative/dflash.py drives it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quickdraft.config import RopeConfig
from quickdraft.models import rope as ropes
from quickdraft.models.transformer import Linear, RMSNorm, apply_rotary
from quickdraft.runtime.kv_cache import KVCache


@dataclass(frozen=True)
class DFlashConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    bias: bool
    rope: RopeConfig
    vocab_size: int
    target_layers: tuple[int, ...]  # the target layers whose outputs it reads, in order
    block_size: int
    mask_token: int
    layer_types: tuple[str, ...]  # "full" or "sliding" per layer
    sliding_window: int | None = None
    causal: bool | None = None  # the config's is_causal; None: causal only in sliding layers
    embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    softcap: float | None = None
    conv_kernel: int = 0  # DFlash2: its convolutions' kernel size (0: DFlash)
    conv_group: int = 0
    selector_rank: int = 0  # DFlash2: the candidate selector's rank and candidates per position
    selector_top_k: int = 0
    kind: str = "dflash"  # dflash | dflash2 | dspark
    # vLLM's speculators form (speculators_model_type dflash, dspark): its own output layer over a draft vocabulary
    # (0: the target's head), whether the block's first row (the pending token's) guesses too, and DSpark's heads
    draft_vocab: int = 0
    sample_from_anchor: bool = False
    markov_rank: int = 0  # DSpark's Markov logit bias (0: none): W2(W1[previous token]), gated or recurrent
    markov_type: str = "vanilla"  # vanilla | gated | rnn
    confidence: bool = False  # DSpark's confidence head: each guess's predicted chance of acceptance
    confidence_with_markov: bool = False  # it reads W1[previous token] beside the row

    @property
    def guesses(self) -> int:
        """Guesses a block makes: its rows after the pending token's, and that row too where it guesses."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over the block's rows: each output row is the sum over the
    kernel's offsets of (a fixed kernel + a kernel computed from the row's own input) times the row `offset` before,
    per group of channels; rows before the block's first count as zero. `prepare` convolves with the first pair and
    returns the second dynamic kernel, which `finish` applies to what the layer's part made of it."""

    def __init__(self, dim: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, dim))
        self.kernel_projection = Linear(dim, 2 * kernel * (dim // group), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = x.shape[-1] // self.group
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])

    def _convolve(self, x, dynamic, base):
        B, L, D = x.shape
        groups = D // self.group
        blocks = x.view(B, L, groups, self.group)
        dynamic = dynamic.reshape(B, L, self.kernel, groups, 1)
        out = torch.zeros_like(blocks)
        for offset in range(self.kernel):
            shifted = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
            out = out + base[offset].view(1, 1, groups, self.group).to(x.dtype) * shifted
            out = torch.addcmul(out, dynamic[:, :, offset], shifted)
        return out.view_as(x)


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int):
        super().__init__()
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, D
        self.kind = cfg.layer_types[index]
        self.window = cfg.sliding_window if self.kind == "sliding" else None
        self.causal = self.kind == "sliding" if cfg.causal is None else cfg.causal
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.q_proj = Linear(cfg.dim, H * D, bias=cfg.bias)
        self.k_proj = Linear(cfg.dim, Hkv * D, bias=cfg.bias)
        self.v_proj = Linear(cfg.dim, Hkv * D, bias=cfg.bias)
        self.o_proj = Linear(H * D, cfg.dim, bias=cfg.bias)
        self.q_norm = RMSNorm(D, cfg.norm_eps)
        self.k_norm = RMSNorm(D, cfg.norm_eps)
        self.gate_proj = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = Linear(cfg.ffn_dim, cfg.dim, bias=False)
        conv = cfg.kind == "dflash2"
        self.attention_conv = DynamicConv(cfg.dim, cfg.conv_kernel, cfg.conv_group) if conv else None
        self.mlp_conv = DynamicConv(cfg.dim, cfg.conv_kernel, cfg.conv_group) if conv else None

    def forward(self, x, context, cos, sin, cache: KVCache, index: int) -> torch.Tensor:
        """x (1, B, dim): the block's rows; context (1, C, dim): the new context rows, whose keys and values go into
        the cache at cache.length on, the block's after them (the caller drops those). cos, sin: (C + B, R)."""
        h = self.input_layernorm(x)
        dynamic = None
        if self.attention_conv is not None:
            h, dynamic = self.attention_conv.prepare(h)
        h = self._attention(h, context, cos, sin, cache, index)
        if dynamic is not None:
            h = self.attention_conv.finish(h, dynamic)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, dynamic = self.mlp_conv.prepare(h)
        h = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        if self.mlp_conv is not None:
            h = self.mlp_conv.finish(h, dynamic)
        return x + h

    def _attention(self, x, context, cos, sin, cache: KVCache, index: int) -> torch.Tensor:
        B, D = x.shape[1], self.head_dim
        both = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(1, B, self.n_heads, D)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(1, -1, self.n_kv_heads, D)).transpose(1, 2)
        v = self.v_proj(both).view(1, -1, self.n_kv_heads, D).transpose(1, 2)
        q = apply_rotary(q, cos[-B:], sin[-B:])
        k = apply_rotary(k, cos, sin)
        k, v = cache.write(index, k, v)
        mask = None
        if self.causal or self.window:
            queries = torch.arange(k.shape[2] - B, k.shape[2], device=x.device)[:, None]
            keys = torch.arange(k.shape[2], device=x.device)[None, :]
            mask = torch.ones(B, k.shape[2], dtype=torch.bool, device=x.device)
            if self.causal:
                mask &= keys <= queries
            if self.window:
                mask &= queries - keys < self.window
                if not self.causal:
                    mask &= keys - queries < self.window
        repeat = self.n_heads // self.n_kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                             attn_mask=mask, scale=D ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(1, B, -1))


class Selector(nn.Module):
    """DFlash2's candidate selector: scores(position, candidate) = the head's logit + <pred[previous token] *
    proj(hidden at position), succ[candidate]>."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = Linear(cfg.dim, cfg.selector_rank, bias=False)

    def candidates(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple:
        """hidden (P, dim), logits (P, V) -> (unary scores (P, top_k), candidates (P, top_k), projected (P, rank))."""
        unary, candidates = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1, sorted=False)
        return unary, candidates, self.hidden_projection(hidden)

    def scores(self, unary, candidates, projected, position: int, previous: torch.Tensor) -> torch.Tensor:
        """The candidates' scores (top_k,) at `position` after the token `previous` (a 0-d or (1,) id tensor)."""
        pairing = self.predecessor_codebook(previous.view(-1))[0] * projected[position]
        return unary[position] + self.successor_codebook(candidates[position]) @ pairing


class MarkovHead(nn.Module):
    """DSpark's sequential logit bias over the draft vocabulary, from the token before each guess (W1 indexes the
    target's vocabulary, W2 maps to the draft's): vanilla W2(W1[prev]); gated W2(sigmoid(gate([row; W1[prev]])) *
    W1[prev]); rnn a state carried over the block's rows, W2(tanh(out)) of a gated update from [state; W1[prev];
    row]."""

    def __init__(self, cfg: DFlashConfig, draft_vocab: int):
        super().__init__()
        r = cfg.markov_rank
        self.kind, self.rank = cfg.markov_type, r
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = Linear(r, draft_vocab, bias=False)
        self.gate_proj = Linear(cfg.dim + r, r) if self.kind == "gated" else None
        self.joint_proj = Linear(2 * r + cfg.dim, 3 * r) if self.kind == "rnn" else None

    def step(self, previous: torch.Tensor, row: torch.Tensor, state: torch.Tensor | None):
        """The bias (draft vocab,) of a row (dim,) after the token `previous` (a (1,) id), W1[previous] (rank,) and
        the recurrent state after the row (None but for rnn; `state` None: the block's first row)."""
        emb = self.markov_w1(previous.view(-1))[0]
        dtype = self.markov_w2.weight.dtype
        emb, row = emb.to(dtype), row.to(dtype)
        if self.kind == "vanilla":
            return self.markov_w2(emb[None])[0], emb, None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([row, emb])[None])[0])
            return self.markov_w2((gate * emb)[None])[0], emb, None
        state = emb.new_zeros(self.rank) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, emb, row])[None])[0].chunk(3)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)[None])[0], emb, state


class ConfidenceHead(nn.Module):
    """DSpark's predicted chance that a guess is accepted: sigmoid(proj([row; W1[prev]])) (or of the row alone)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features[None])[0, 0].float())


class HeadLayers(nn.Module):
    """What a drafter's layers over the target's states (DFlash here, EAGLE-3: models/eagle3.py) say of themselves:
    their device and dtype (their final norm's), their caches' layout and their norms' kernel plan."""

    cfg: DFlashConfig

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def kv_layout(self) -> list[tuple[int, int, int]]:
        return [(self.cfg.n_kv_heads, self.cfg.head_dim, i) for i in range(self.cfg.n_layers)]

    def plan(self, kernels: bool) -> None:
        for norm in self.modules():
            if isinstance(norm, RMSNorm):
                norm.plan(kernels)


class DFlash(HeadLayers):
    def __init__(self, cfg: DFlashConfig, target_dim: int, max_context: int):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layers))
        self.fc = Linear(len(cfg.target_layers) * target_dim, cfg.dim, bias=False)
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.candidate_selector = Selector(cfg) if cfg.kind == "dflash2" else None
        vocab = cfg.draft_vocab or cfg.vocab_size
        self.lm_head = Linear(cfg.dim, cfg.draft_vocab, bias=False) if cfg.draft_vocab else None
        self.markov_head = MarkovHead(cfg, vocab) if cfg.markov_rank else None
        self.confidence_head = ConfidenceHead(cfg.dim + (cfg.markov_rank if cfg.confidence_with_markov else 0)) \
            if cfg.confidence else None
        # its output layer's id -> the target's (the identity without a draft vocabulary of its own)
        self.register_buffer("target_ids", torch.arange(vocab), persistent=False)
        cos, sin = ropes.tables(cfg.rope, cfg.head_dim, max_context + cfg.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def max_context(self) -> int:
        return self.rope_cos.shape[0] - self.cfg.block_size

    @property
    def hybrid(self) -> bool:
        return False

    def block(self, features: torch.Tensor, embedded: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One drafting pass: features (C, n * target dim), the target's hidden states of the C context positions
        from cache.length on, taken into the cache; embedded (B, dim), the block's input rows at the positions
        after them. Returns the block's normed hidden states (B, dim); the cache holds the context after it."""
        C, B = features.shape[0], embedded.shape[0]
        start = cache.length
        if start + C + B > cache.capacity:
            raise ValueError(f"positions up to {start + C + B} exceed the drafter's context of {cache.capacity}")
        if C:
            context = self.hidden_norm(self.fc(features.to(self.dtype)[None]))
        else:  # every context row is in the cache already (a prompt resent whole)
            context = embedded.new_zeros(1, 0, self.cfg.dim).to(self.dtype)
        cos, sin = self.rope_cos[start:start + C + B], self.rope_sin[start:start + C + B]
        x = embedded.to(self.dtype)[None]
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, cache, i)
        cache.length = start + C  # the block's keys and values are this pass's alone
        return self.norm(x)[0]
