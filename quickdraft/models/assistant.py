"""Gemma 4's assistant drafter (transformers' Gemma4AssistantForCausalLM), as tensor math.

A small gemma4 text model with no keys and values of its own: every layer attends to its target's, those of the
target's last layer of the same kind (sliding or full) that computes its own (transformers' `shared_kv_states`). A
step takes [the target's embedding of a token, a hidden state of the target's width], projects it down
(pre_projection), runs the layers with the query at one position over the target's committed positions (all of them
for a full layer, the last `sliding_window` + 1 for a sliding one, as transformers' mask has it), norms, and gives logits through its head and a hidden
state projected back up (post_projection) for the next step. A round's first step takes the pending token with the
target's hidden state of the position before it; each further step the token just drafted with the step's own
hidden state, at the same position over the same keys (speculative/assistant.py drives it).

The head is its embedding table (tied); with ordered embeddings (`centroids`) it scores only the tokens of the
`centroid_top_k` clusters whose centroids score highest, every other token one below the lowest score, as
transformers' Gemma4AssistantMaskedEmbedder does.
"""

from __future__ import annotations

import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models.transformer import Block, Decoder, Linear, RMSNorm, linear


class Assistant(Decoder):
    def __init__(self, cfg: ModelConfig, max_context: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)  # its head (tied); its inputs are the target's
        self.output = None  # a quantized copy of the head where the weight format asks (weights/loader.py)
        self.pre_projection = Linear(2 * cfg.assistant_backbone, cfg.dim, bias=False)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        for block in self.layers:  # transformers' bidirectional window: keys at a distance up to the window from
            if block.attention.window:  # the query's position, so the last window + 1 committed positions
                block.attention.window += 1
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_projection = Linear(cfg.dim, cfg.assistant_backbone, bias=False)
        if cfg.centroids:
            self.centroids = Linear(cfg.dim, cfg.centroids, bias=False)
            self.token_ordering = nn.Parameter(torch.zeros(cfg.vocab_size, dtype=torch.long), requires_grad=False)
        self.kinds = sorted({cfg.layer_kind(i) for i in range(cfg.n_layers)})
        self.set_rotary(max_context or cfg.max_context)

    @property
    def hybrid(self) -> bool:
        return False

    def kv_layout(self) -> list:
        return []  # no keys and values of its own

    def state_layout(self):
        return None

    def plan(self, kernels: bool, fused_layers: bool = True) -> dict:
        for block in self.layers:
            block.plan(kernels, False, self._tables(block.attention.kind)[0].shape[-1])
        self.norm.plan(kernels)
        return {"layers": len(self.layers), "fused_layers": 0}

    def step(self, embedded: torch.Tensor, hidden: torch.Tensor, keys: "TargetKeys",
             position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step: embedded (1, 1, backbone) the target's embedding of a token, hidden (1, 1, backbone);
        the query at `position`, over the target's keys and values before it. Returns (float32 logits (1, 1, V),
        the next hidden state (1, 1, backbone))."""
        x = self.pre_projection(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1))
        for i, layer in enumerate(self.layers):
            cos, sin = (t[position:position + 1] for t in self._tables(layer.attention.kind))
            x = layer(x, cos, sin, keys, i, None)
        h = self.norm(x)
        return self.head(h), self.post_projection(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states (1, S, D) -> float32 logits (1, S, V)."""
        if not self.cfg.centroids:
            return (self.output(h) if self.output is not None else linear(h, self.tok_embeddings.weight)).float()
        cfg = self.cfg
        scores = linear(h, self.centroids.weight)  # (1, S, C)
        chosen = scores.topk(cfg.centroid_top_k, dim=-1).indices  # (1, S, top_k)
        members = self.token_ordering.view(cfg.centroids, cfg.vocab_size // cfg.centroids)[chosen]
        members = members.reshape(*h.shape[:2], -1)  # (1, S, top_k * V / C): the candidate tokens
        rows = torch.stack([linear(h[0, s:s + 1], self._head_rows(members[0, s]))[0] for s in range(h.shape[1])])
        out = torch.full((*h.shape[:2], cfg.vocab_size), float(rows.min()) - 1.0, dtype=rows.dtype, device=h.device)
        return out.scatter_(-1, members, rows[None]).float()

    def _head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.tok_embeddings
        if hasattr(table, "rows"):  # a quantized table (quant/embedding.py)
            return table.rows(ids)
        return table.weight[ids]


class TargetKeys:
    """A target's KV cache as an assistant's layers read it: layer i sees the keys and values of the target's layer
    sources[i], its first `committed` positions (the query sits at position `committed`, the pending token's)."""

    def __init__(self, cache, sources: list[int], committed: int):
        self.cache, self.sources, self.committed = cache, sources, committed

    def read(self, layer: int, new: int):
        source = self.sources[layer]
        return self.cache.k[source][:, :, :self.committed], self.cache.v[source][:, :, :self.committed]

    def write(self, layer: int, k, v):
        raise AssertionError("an assistant's layers have no keys and values of their own")


def sources(assistant: Assistant, target) -> list[int]:
    """The target layer each assistant layer reads: the target's last layer of its kind that computes its own keys
    and values (transformers' "store" layers). QuickdraftError where the target has none of that kind, or keys and
    values of other shapes than the assistant's layers take."""
    from quickdraft.errors import QuickdraftError

    cfg = target.cfg
    first_shared = cfg.n_layers - cfg.kv_shared_layers
    layout = target.kv_layout()
    out = []
    for block in assistant.layers:
        kind = block.attention.kind
        own = [j for j in range(first_shared) if cfg.layer_kind(j) == kind]
        if not own:
            raise QuickdraftError(f"the assistant has {kind} attention layers and its target none: it was trained "
                                  "for another target")
        heads, dim, _ = layout[own[-1]]
        need = (block.attention.n_kv_heads, block.attention.head_dim)
        if (heads, dim) != need:
            raise QuickdraftError(f"the assistant's {kind} layers read {need[0]} key/value heads of {need[1]}, the "
                                  f"target's have {heads} of {dim}: it was trained for another target")
        out.append(own[-1])
    return out
