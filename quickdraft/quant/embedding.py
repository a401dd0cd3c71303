"""Embedding tables kept small: a vocabulary-sized table is the largest tensor of a small model (a large share of
its bytes in bf16), yet one step reads one row of it. In the quantized weight formats the table
stays compact and a lookup dequantizes only the rows it needs:

- from a GGUF file in a block format (Q4_K, Q5_0, ...): the file's own blocks (`BlockEmbedding`), so the rows
  are bit for bit those of a bf16 load, in the file's size;
- otherwise (bf16 safetensors, float GGUF tables): quantized here (`QuantEmbedding`), in groups of 32 with a
  float16 scale per group: int8 symmetric, or int4 on the grid `int4.quantize` fits, two codes to a byte.
"""

from __future__ import annotations

import torch
from torch import nn

from quickdraft.quant import int4, vnni
from quickdraft.quant import blocks

ROWS = 4096  # rows converted at a time: the table (or the file's rows behind it) is never float32 in full
GROUP = 32


def quantized_width(kind: str) -> int:
    """What a quantized table's rows must be a multiple of: whole groups (int8), int4's packing chunks of 128."""
    return GROUP if kind == "int8" else 128


def table(kind: str, weight) -> nn.Module | None:
    """The compact table for weight (V, D) as quant/placement.table_kind places it: "blocks" (the file's rows,
    gguf.FileRows), int8 or int4 (a tensor, or the file's rows); None for a float table."""
    if kind == "blocks":
        return BlockEmbedding(weight.raw, weight.qtype, weight.shape)
    if kind in ("int8", "int4"):
        return QuantEmbedding(kind, weight)
    return None


class _Rows(nn.Module):
    dtype = torch.bfloat16  # the quantized formats run bf16 activations

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.rows(tokens.reshape(-1)).reshape(*tokens.shape, self.embedding_dim)

    def row_bytes(self) -> int:
        """Bytes one lookup of one token reads."""
        return sum(b[0].numel() * b.element_size() for b in self.buffers())


class BlockEmbedding(_Rows):
    def __init__(self, raw, qtype, shape: tuple[int, int]):
        """raw: the file's (V, bytes per row) uint8 array, copied here (the file is closed after loading)."""
        super().__init__()
        self.qtype = qtype
        self.num_embeddings, self.embedding_dim = shape
        blocks = torch.empty(raw.shape, dtype=torch.uint8)
        for i in range(0, raw.shape[0], ROWS):  # straight from the mapped file into the buffer
            blocks.numpy()[i:i + ROWS] = raw[i:i + ROWS]
        self.register_buffer("blocks", blocks)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return blocks.dequantize_rows(self.blocks[ids], self.qtype, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks"


class QuantEmbedding(_Rows):
    def __init__(self, fmt: str, weight):
        """weight: (V, D), a tensor or anything that gives float rows by slicing."""
        super().__init__()
        self.fmt = fmt
        self.num_embeddings, self.embedding_dim = weight.shape
        parts: list[tuple[torch.Tensor, ...]] = []
        for i in range(0, self.num_embeddings, ROWS):
            rows = weight[i:i + ROWS]
            if fmt == "int8":
                groups = rows.float().reshape(rows.shape[0], -1, GROUP)
                scale = (groups.abs().amax(-1) / 127).clamp_min(1e-8).to(torch.float16)
                q = (groups / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
                parts.append((q.reshape(rows.shape), scale))
            else:
                q, s, lo = int4.quantize(rows, torch.float16)
                parts.append((vnni.pack_int4(q), s, lo))
        names = ("codes", "scales") if fmt == "int8" else ("codes", "scales", "lows")
        for j, name in enumerate(names):
            self.register_buffer(name, torch.cat([p[j] for p in parts]))

    @staticmethod
    def nbytes_for(fmt: str, rows: int, dim: int) -> int:
        """Bytes of a (rows, dim) table in fmt: the codes (a byte each, or two to a byte), a float16 scale per group
        (and a low for int4)."""
        codes = rows * dim // (1 if fmt == "int8" else 2)
        return codes + rows * dim // GROUP * (2 if fmt == "int8" else 4)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ids (n,) -> (n, D): exactly what the codes stand for."""
        if self.fmt == "int4":
            return int4.dequantize(vnni.unpack_int4(self.codes[ids]), self.scales[ids], self.lows[ids]).to(self.dtype)
        n = ids.shape[0]
        w = self.codes[ids].float().reshape(n, -1, GROUP) * self.scales[ids].float()[..., None]
        return w.reshape(n, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"
