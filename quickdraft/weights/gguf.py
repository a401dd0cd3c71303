"""GGUF files (read with the `gguf` package) -> ModelConfig, model-named tensors, tokenizer metadata."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.quant.blocks import BLOCK_TYPES, FOUR_BIT_TYPES, SUPPORTED_TYPES, dequantize
from quickdraft.weights import families
from quickdraft.weights.names import gguf_model_names, unpermute_rotary


def open_gguf(path: Path | str) -> GGUFReader:
    path = Path(path)
    values, end = prescan(path)  # the reader trusts every count in the file: check them first
    try:
        return _Reader(path, values, end)
    except Exception as e:  # the reader raises ValueError/struct errors on anything not GGUF
        raise QuickdraftError(f"{path} is not a readable GGUF file ({e}); check the path or re-download it") from e


class _Reader(GGUFReader):
    """The gguf package's reader, with the key/value section taken from the prescan (plain Python values) instead of
    its own parse, which makes two numpy views of every string of a vocabulary: 7 s of every load of a 151,936-token
    model, 10 s of a 262,144-token one (the prescan reads the whole section in 0.1 s). The tensors are the package's."""

    def __init__(self, path: Path, values: dict, end: int):
        self.values, self._end = values, end
        super().__init__(path)

    def _build_fields(self, offs: int, count: int) -> int:
        align = self.values.get("general.alignment")
        if align is not None:  # the base reader takes the data's alignment from its field
            self.fields["general.alignment"] = ReaderField(
                offs, "general.alignment", [np.array([align], dtype=np.uint32)], [0],
                [GGUFValueType.UINT32 if isinstance(align, int) else GGUFValueType.STRING])
        return self._end


# GGUF's scalar value types (gguf.GGUFValueType: 8 is a string, 9 an array) as numpy reads them (little-endian)
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_SCALAR = {kind: np.dtype(t).itemsize for kind, t in _NUMPY.items()}
MAX_DIMS = 4


def prescan(path: Path) -> tuple[dict, int]:
    """Walk the header of a GGUF file, checking each count against the bytes the file has, before the gguf
    library parses it: that library believes a count (an array said to hold 2^40 items is read item by item,
    growing memory without end). QuickdraftError names the first count that cannot be right. Returns the key/value
    metadata (plain Python values, as the library's ReaderField.contents() gives them) and the offset where that
    section ends."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    try:
        scan = _Scan(data, path)
        return scan.run(), scan.kv_end
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


class _Scan:
    def __init__(self, data, path: Path):
        self.data, self.path, self.at, self.kv_end = data, path, 0, 0

    def fail(self, what: str):
        raise QuickdraftError(f"{self.path} is not a readable GGUF file: {what}; re-download or re-convert it")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            self.fail(f"{what} runs past the end of the file (byte {self.at} of {len(self.data)})")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def u64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "little")

    def string(self, what: str) -> bytes:
        return self.take(self.u64(f"the length of {what}"), what)

    def run(self) -> dict:
        if self.take(4, "the magic number") != b"GGUF":
            self.fail("it does not start with GGUF's magic number")
        version = self.u32("the version")
        if version not in (2, 3):
            self.fail(f"version {version} (quickdraft reads versions 2 and 3)")
        tensors, kvs = self.u64("the tensor count"), self.u64("the metadata count")
        left = len(self.data) - self.at
        if tensors > left // 24 or kvs > left // 12:  # the smallest tensor record and key/value pair
            self.fail(f"it claims {tensors} tensors and {kvs} metadata keys, more than its {left} bytes can hold")
        values = {}
        for _ in range(kvs):
            key = self.string("a metadata key").decode("utf-8", "replace")
            values[key] = self.value(self.u32(f"the type of {key}"), key)
        self.kv_end = self.at
        for _ in range(tensors):
            self.tensor()
        return values

    def value(self, kind: int, key: str):
        if kind in _SCALAR:
            return np.frombuffer(self.take(_SCALAR[kind], key), _NUMPY[kind])[0].item()
        if kind == 8:
            return self.string(key).decode("utf-8")
        if kind == 9:
            item, count = self.u32(f"the item type of {key}"), self.u64(f"the length of {key}")
            size = _SCALAR.get(item)
            if size is not None:  # fixed-size items: the whole array must be there
                return np.frombuffer(self.take(count * size, f"{key} ({count} items)"), _NUMPY[item]).tolist()
            if item in (8, 9):
                if count > (len(self.data) - self.at) // 8:  # each item at least a length
                    self.fail(f"{key} claims {count} items, more than the rest of the file can hold")
                return [self.value(item, key) for _ in range(count)]
            self.fail(f"{key} has items of unknown type {item}")
        self.fail(f"{key} has unknown type {kind}")

    def tensor(self) -> None:
        name = self.string("a tensor name").decode("utf-8", "replace")
        dims = self.u32(f"the dimensions of {name}")
        if not 1 <= dims <= MAX_DIMS:
            self.fail(f"tensor {name} has {dims} dimensions")
        shape = [self.u64(f"the shape of {name}") for _ in range(dims)]
        self.u32(f"the type of {name}")
        self.u64(f"the offset of {name}")
        elements = 1
        for n in shape:
            elements *= n
        if elements > 8 * len(self.data):  # at most 8 elements a byte in any block type quickdraft reads
            self.fail(f"tensor {name} has shape {shape}: more elements than the file has bytes for")


def metadata(reader: GGUFReader) -> dict:
    """All key/value metadata as plain Python values."""
    if isinstance(reader, _Reader):
        return dict(reader.values)
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}


def drop_metadata(reader: GGUFReader) -> None:
    """Free the reader's parsed key/value fields (the tensors stay readable): the gguf library keeps every
    element of the vocabulary and merges arrays as numpy objects, hundreds of MB for a large vocabulary."""
    for parsed in (getattr(reader, "fields", None), getattr(reader, "values", None)):
        if hasattr(parsed, "clear"):
            parsed.clear()


def config_from_metadata(meta: dict, reader_or_shapes) -> ModelConfig:
    """The model's shape from the file's metadata, checked against the tensors it holds (weights/gguf_config.py):
    a GGUFReader, or shapes (name -> shape, fastest dimension last, as PyTorch writes it)."""
    from quickdraft.weights import gguf_config

    if isinstance(reader_or_shapes, dict):
        return gguf_config.config(meta, reader_or_shapes, {})
    reader = reader_or_shapes
    small = {t.name: [float(x) for x in t.data.reshape(-1)] for t in reader.tensors
             if t.name in gguf_config.CONFIG_TENSORS}
    return gguf_config.config(meta, tensor_shapes(reader), small)


def tensor_shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, fastest dimension last (GGUF lists it first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def check_tensor_types(reader: GGUFReader) -> None:
    """Fail before the long part of a load if any tensor is in a format we cannot read."""
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(x.name for x in SUPPORTED_TYPES)
            raise QuickdraftError(
                f"tensor {t.name} has type {t.tensor_type.name}, which quickdraft does not read "
                f"(supported: {names}); use a file quantized to one of these, e.g. Q4_K_M or Q8_0"
            )


def read_tensors(reader: GGUFReader, cfg: ModelConfig, dtype: torch.dtype, progress=None, lazy: bool = False,
                 types: dict | None = None, lazy_matrices: bool = False):
    """Dequantize every tensor the model uses into `dtype`, one at a time: yields (model name, tensor).
    types: filled with each model name's GGUF tensor type as it is read.

    lazy: the vocabulary-sized tables come as FileRows, dequantized by the consumer a block of rows at a time
    (for a loader that quantizes them: they are never in full precision in full). lazy_matrices: every matrix
    in a block format too (a loader that converts the blocks themselves: FileRows.grid).
    `progress(nbytes)` is called after each tensor with the bytes it covered.
    """
    for t in reader.tensors:
        got = gguf_model_names(t.name, cfg)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dimension first
        # a MoE layer's stacked experts come as one matrix each: slices of the file's data
        parts = [(got[0], t.data, shape)] if len(got) == 1 else [(n, t.data[e], shape[1:]) for e, n in enumerate(got)]
        for name, raw, shape in parts:
            if types is not None:
                types[name] = t.tensor_type
            yield name, _tensor(name, raw, t.tensor_type, shape, cfg, dtype, lazy, lazy_matrices)
        _release(reader, t)
        if progress is not None:
            progress(int(t.n_bytes))


def _tensor(name: str, raw, qtype, shape: tuple[int, ...], cfg: ModelConfig, dtype: torch.dtype, lazy: bool,
            lazy_matrices: bool):
    """One model tensor from the file's data, as read_tensors gives it: FileRows where it stays in the file, else
    dequantized; llama's rotary rows and qwen3.5's recurrent parameters back in the model's own convention."""
    rotary = families.get(cfg.arch).rotary_permuted and name.endswith(("attention.wq.weight", "attention.wk.weight"))
    if rotary:
        heads = cfg.n_heads if name.endswith("wq.weight") else cfg.n_kv_heads
    if name.endswith("attention.A_log"):  # llama.cpp's converter writes ssm_a = -exp(A_log)
        return (-dequantize(raw, qtype, shape, torch.float64)).log().to(dtype)
    if name.endswith("attention.conv_weight"):  # squeezed to (channels, kernel) there
        return dequantize(raw, qtype, shape, dtype).unsqueeze(1)
    if lazy and name in FileRows.NAMES:
        return FileRows(raw, qtype, shape, dtype)
    if lazy_matrices and len(shape) == 2 and qtype in BLOCK_TYPES:
        if rotary:
            raw = raw[unpermute_rotary(torch.arange(shape[0])[:, None], heads)[:, 0].numpy()]
        return FileRows(raw, qtype, shape, dtype)
    w = dequantize(raw, qtype, shape, dtype)
    return unpermute_rotary(w, heads) if rotary else w


class FileRows:
    """A 2-D tensor still in the file that slicing rows dequantizes: `rows[i:j]` is a (j - i, K) tensor.

    Used only while the consumer runs (before the reader moves on), by quantized layers that read their
    weight a block of rows at a time, and by embedding tables that keep the raw blocks."""

    NAMES = ("tok_embeddings.weight", "output.weight", "ple_embeddings.weight")
    device = torch.device("cpu")

    def __init__(self, raw, qtype, shape: tuple[int, int], dtype: torch.dtype):
        self.raw, self.qtype, self.shape, self.dtype = raw, qtype, torch.Size(shape), dtype

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "FileRows slices whole blocks of rows"
        return dequantize(self.raw[start:stop], self.qtype, (stop - start, self.shape[1]), self.dtype)

    def full(self) -> torch.Tensor:
        return self[:]

    @property
    def four_bit(self) -> bool:
        """Whether the rows are in 4-bit blocks that `grid` converts as they are."""
        return self.qtype in FOUR_BIT_TYPES

    def grid(self):
        """The rows as their blocks' own 4-bit codes and grids (an int4.Grid), for a Q4_0 / Q4_1 / Q4_K tensor:
        the bytes go to the device as they are and are unpacked there."""
        from quickdraft.quant.int4 import Grid
        from quickdraft.quant.blocks import _as_torch, four_bit_grid

        def rows(i: int, j: int, device):
            return four_bit_grid(_as_torch(self.raw[i:j]).to(device), self.qtype)

        return Grid(self.shape, rows)


def _release(reader: GGUFReader, t) -> None:
    """Drop the file pages of a tensor already read from the process (the file stays mapped: they come back
    from disk if touched again), so that loading does not hold the whole file in memory on top of the model."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) - int(t.data_offset) % mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):  # advice only
        pass


class StackedRows:
    """Row-wise concatenated matrices still in the file (a fused projection's parts, as FileRows): slicing rows
    dequantizes them, `grid` gives their 4-bit blocks' codes when every part is in 4-bit blocks."""

    device = torch.device("cpu")

    def __init__(self, parts: list):
        self.parts = parts
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + p.shape[0])
        self.shape = torch.Size((self.offsets[-1], parts[0].shape[1]))
        self.dtype = parts[0].dtype

    def dim(self) -> int:
        return 2

    @property
    def four_bit(self) -> bool:
        return all(getattr(p, "four_bit", False) for p in self.parts)

    def _pieces(self, start: int, stop: int):
        """(part index, first row, end row) of each part rows start:stop cover, in the part's own rows."""
        for n, (lo, hi) in enumerate(zip(self.offsets, self.offsets[1:])):
            if lo < stop and start < hi:
                yield n, max(start, lo) - lo, min(stop, hi) - lo

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.shape[0])
        return torch.cat([self.parts[n][i:j] for n, i, j in self._pieces(start, stop)])

    def full(self) -> torch.Tensor:
        return self[:]

    def grid(self):
        from quickdraft.quant.int4 import Grid

        grids = [p.grid() for p in self.parts]

        def rows(start: int, stop: int, device):
            got = [grids[n].rows(i, j, device) for n, i, j in self._pieces(start, stop)]
            return tuple(torch.cat(ts) for ts in zip(*got))

        return Grid(self.shape, rows)


def cat_rows(parts: list):
    """Row-wise concatenation of tensors, or of matrices still in the file (StackedRows) when any part is one."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    return StackedRows([p if not isinstance(p, torch.Tensor) else _InMemory(p) for p in parts])


class _InMemory:
    """A tensor among file rows (a float part of a fused projection): sliced as it is, never 4-bit blocks."""

    four_bit = False

    def __init__(self, t: torch.Tensor):
        self.t, self.shape, self.dtype = t, t.shape, t.dtype

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.t[rows]
