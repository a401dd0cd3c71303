"""From what a user types after -m (an alias, a .gguf file, a Hugging Face directory) to a model on a device."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from quickdraft import quant
from quickdraft.config import DEFAULT_MAX_CONTEXT, EngineConfig, ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models import build
from quickdraft.models.transformer import ROWWISE_MAX, Transformer
from quickdraft.quant import embedding, int4, placement
from quickdraft.runtime import heap
from quickdraft.runtime.graphs import StepGraphs
from quickdraft.runtime.plan import plan as plan_kernels
from quickdraft.tokenizer import Tokenizer
from quickdraft.ui import progress_bar
from quickdraft.weights import converted, gguf as gguf_io, hub, names, safetensors as st_io


@dataclass
class LoadedModel:
    name: str  # the source it was loaded from, as given (an alias or a path)
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    load_seconds: float
    weights: str = "bf16"  # the runtime weight format: bf16 (the dtype's), int8, int4 or mixed
    kept_from: Path | None = None  # the kept conversion it was read from (weights/converted.py), if it was
    plan: dict = field(default_factory=dict)  # which kernels run it (runtime/plan.py)
    graphs: StepGraphs | None = None  # on CUDA: its decode and verification passes replay CUDA graphs
    # On CUDA (runtime/plan.py): every pass of fewer tokens than this is run as this many (the graphs' width, and
    # eagerly padded where no graph runs), because CUDA kernels choose their arithmetic by the shape: one shape for
    # every short pass gives a position the same logits in a plain step and in a verification. A round's drafts are
    # bounded by it (Engine.max_draft). None: the passes run as they are (the CPU's kernels are row-invariant).
    rows: int | None = None

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, tokens: torch.Tensor, cache, last_only: bool = False, head=None) -> torch.Tensor:
        """One pass of the model (Transformer.forward), replayed from a captured CUDA graph where one applies
        (not with a head of the caller's), else padded to `rows` tokens where that is set and fits."""
        if head is None and self.graphs is not None and self.graphs.applies(tokens, cache):
            return self.graphs.run(tokens, cache, last_only)
        S, width = tokens.shape[1], self.rows
        if (width is not None and S < width and tokens.shape[0] == 1 and isinstance(self.model, Transformer)
                and cache.length + width <= cache.capacity and cache.position + width <= self.model.max_context):
            start = cache.length
            logits = self.model(F.pad(tokens, (0, width - S)), cache, False, head, rows=S)
            cache.rollback(start + S)  # the padding's positions are not the sequence's
            return logits[:, S - 1:S] if last_only else logits[:, :S]
        return self.model(tokens, cache, last_only, head)

    def forward_segments(self, feeds: list[torch.Tensor], caches: list, last_only: list[bool],
                         trees: list | None = None) -> list[torch.Tensor]:
        """Several sequences' passes as one (Transformer.forward_segments): per sequence its logits (S_i, V), or
        (1, V) where last_only; trees[i] (depths, chain_rows): that sequence's rows are a tree's (where `trees`).
        On CUDA, where a pass's shape decides its arithmetic (rows), each runs as its own pass: the same output,
        without the batch's saving."""
        if self.rows is None and isinstance(self.model, Transformer):
            return self.model.forward_segments(feeds, caches, last_only, trees)
        if any(trees or ()):
            raise ValueError(f"{self.name}: tree verification runs on the CPU")
        return [self.forward(f[None], c, last)[0] for f, c, last in zip(feeds, caches, last_only)]

    @property
    def trees(self) -> bool:
        """Whether its tree passes (forward_tree) are bit for bit its chain passes and plain steps: the CPU's
        row-wise kernels (a CUDA pass's shape decides its arithmetic: not checked there)."""
        return self.rows is None and isinstance(self.model, Transformer)

    def forward_tree(self, tokens: torch.Tensor, depths: list[int], chain_rows: int, cache) -> torch.Tensor:
        """A tree's verification pass (Transformer.forward_tree): logits (S, V) of its rows."""
        if not self.trees:
            raise ValueError(f"{self.name}: tree verification runs on the CPU")
        return self.model.forward_tree(tokens, depths, chain_rows, cache)

    def prefill(self, tokens: torch.Tensor, cache, head=None) -> torch.Tensor:
        """Run tokens (1, S) in passes of at most `chunk` tokens: the logits (1, 1, V) of the last. Every row goes
        through the kernels a decoding step uses, so each position's keys and values are the same bits however the
        sequence was cut into passes (prefix reuse relies on it), and a long prompt's activations stay bounded."""
        logits = None
        for i in range(0, tokens.shape[1], self.chunk):
            logits = self.forward(tokens[:, i:i + self.chunk], cache, last_only=True, head=head)
        return logits

    def teacher_forced(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        """The logits (1, S, V) of every row of tokens (1, S), run in the passes prefill cuts them into: each row
        the same bits as decoding computes it (tune's replay reads the rows and the states they leave)."""
        return torch.cat([self.forward(tokens[:, i:i + self.chunk], cache) for i in range(0, tokens.shape[1],
                                                                                         self.chunk)], dim=1)

    @property
    def chunk(self) -> int:
        """The most tokens a prefill pass takes: a CUDA pass's rows, else what the row-wise kernels take at once."""
        return self.rows or ROWWISE_MAX


def resolve(source: str) -> Path:
    """An alias (pulled on first use), a .gguf file or a Hugging Face directory -> a local path."""
    if source in hub.DEFAULT_MODELS:
        return ensure_pulled(source)
    path = Path(source).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").exists()):
        return path
    if path.is_dir():
        raise QuickdraftError(f"{path} is a directory without config.json: give a Hugging Face model directory")
    raise QuickdraftError(
        f"model {source!r} not found: give an alias ({', '.join(hub.DEFAULT_MODELS)}), "
        "a .gguf file or a Hugging Face model directory"
    )


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of a model source alone: no weights are read (a vocabulary-only GGUF file will do)."""
    path = resolve(source)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf_metadata(gguf_io.metadata(gguf_io.open_gguf(path)))


def ensure_pulled(alias: str) -> Path:
    """The local path of a default model, pulling it (with a progress bar) if it is not there yet."""
    path = hub.model_path(alias)  # raises a clear error for an unknown alias
    if not hub.is_pulled(alias):
        with progress_bar(f"pulling {alias}", hub.DEFAULT_MODELS[alias].size) as update:
            hub.pull(alias, progress=lambda done, total: update(done))
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuickdraftError(f"{{device}} {device}: PyTorch sees no CUDA device here; use {{device}} cpu or auto",
                              "device")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise QuickdraftError(f"{{device}} {device!r} is not a device name: use auto, cpu or cuda", "device") from e


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device, weights: str = "auto") -> torch.dtype:
    """The compute dtype `dtype` stands for with `weights` (a format, or auto) on device."""
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise QuickdraftError(f"{{dtype}} {dtype!r}: choose auto, {', '.join(_DTYPES)}", "dtype")
    if device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16  # half the bytes every token reads, computed natively
    from quickdraft.quant import vnni

    # without native bf16: quantized weights run on quickdraft's own kernels (AVX2 or AVX-512 VNNI), which take bf16
    # activations and do the norms, rotary and attention too; float weights on PyTorch's bf16 ops would be emulated
    # (slow), and run in float32 on quickdraft's AVX2 float kernels instead
    return torch.bfloat16 if weights != "bf16" and device.type == "cpu" and vnni.available() else torch.float32


def load_model(source: str, engine: EngineConfig = EngineConfig(), progress: bool | None = None) -> LoadedModel:
    """Load weights, tokenizer and config from source (an alias, a .gguf file or a Hugging Face directory), place
    the model on its device and plan its kernels."""
    start = time.perf_counter()
    path = resolve(source)
    device = resolve_device(engine.device)
    dtype = resolve_dtype(engine.dtype, device, engine.weights)
    weights = quant.resolve(engine.weights, device, dtype)
    kept = None  # where the conversion is kept on disk (quantized formats on the CPU: weights/converted.py)
    _check_format(weights, device, dtype)
    if weights in quant.QUANTIZED and engine.weight_cache and device.type == "cpu":
        kept = converted.location(path, weights, dtype)
        restored = kept and converted.load(kept, lambda cfg: _context(engine, cfg))
        if restored:
            cfg, model, tokenizer = restored
            _return_freed_memory()
            return _ready(LoadedModel(source, path, cfg, model, tokenizer, 0.0, weights, kept), engine, start)
    if path.is_dir():
        cfg = st_io.read_config(path)
        # a Gemma 4 assistant drafts in its target's vocabulary and may come without a tokenizer of its own
        tokenizer = None if cfg.assistant_backbone and not (path / "tokenizer.json").exists() else \
            Tokenizer.from_hf_dir(path)
        context = _context(engine, cfg)
        with progress_bar(f"loading {path.name}", st_io.shard_bytes(path), progress) as update:
            model = build_model(cfg, st_io.read_tensors(path, cfg, dtype, _accumulate(update)), device, context,
                                weights, dtype)
    else:
        reader = gguf_io.open_gguf(path)
        meta = gguf_io.metadata(reader)
        cfg = gguf_io.config_from_metadata(meta, reader)
        gguf_io.check_tensor_types(reader)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        del meta
        gguf_io.drop_metadata(reader)  # the parsed fields of a large vocabulary, not needed from here
        _return_freed_memory()
        context = _context(engine, cfg)
        total = sum(int(t.n_bytes) for t in reader.tensors)
        with progress_bar(f"loading {path.name}", total, progress) as update:
            types: dict = {}  # each tensor's type in the file, for the `mixed` format
            quantized = weights in quant.QUANTIZED
            tensors = gguf_io.read_tensors(reader, cfg, dtype, _accumulate(update), lazy=quantized, types=types,
                                           lazy_matrices=quantized and int4.tinygemm_layout(device))
            model = build_model(cfg, tensors, device, context, weights, dtype, types)
    _return_freed_memory()
    if kept is not None:
        converted.save(kept, model, cfg, tokenizer)
    return _ready(LoadedModel(source, path, cfg, model, tokenizer, 0.0, weights), engine, start)


def _ready(lm: LoadedModel, engine: EngineConfig, start: float) -> LoadedModel:
    ready(lm, engine.cuda_graphs)
    lm.load_seconds = time.perf_counter() - start
    return lm


def ready(lm: LoadedModel, cuda_graphs: bool = True) -> LoadedModel:
    """Plan a loaded model's kernels; on CUDA fix its passes' rows and give them their graphs."""
    lm.plan = plan_kernels(lm.model)
    if lm.device.type == "cuda":
        lm.rows = lm.plan["rows"]
        if cuda_graphs and isinstance(lm.model, Transformer):
            lm.graphs = StepGraphs(lm.model, lm.rows)
    return lm


def _context(engine: EngineConfig, cfg: ModelConfig) -> int:
    """The context a load gives the model: the one asked for, else the model's own, capped at DEFAULT_MAX_CONTEXT."""
    return engine.max_context or min(cfg.max_context, DEFAULT_MAX_CONTEXT)


def _return_freed_memory() -> None:
    """Hand the heap that loading freed (parsed metadata, conversion buffers: ~0.15 GB a model) back to the
    system: glibc keeps freed memory in the process otherwise, and peak memory is what a user meets."""
    heap.trim()


def build_model(cfg: ModelConfig, tensors, device: torch.device, max_context: int, weights: str = "auto",
                dtype: torch.dtype | None = None, source_types: dict | None = None) -> Transformer:
    """A Transformer on `device` from (model name, tensor) pairs (a dict's items or a reader's stream), with
    rotary tables for max_context and its linear layers in the runtime weight format (`mixed`: per module, as
    source_types, the file's tensor types by model name, say: quant.for_source).

    Module by module: each tensor goes to the device (and into its format) as soon as its module is complete,
    so a quantized model never exists in full precision: peak memory stays near the final model's size."""

    _check_format(weights, device, dtype)
    with torch.device("meta"):
        model = build(cfg, max_context)
    modules = dict(model.named_modules())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    items = tensors.items() if isinstance(tensors, dict) else tensors
    attention = {n: m for n, m in modules.items() if n.endswith(".attention")}

    def expected(key: str) -> int:  # the parts a fused projection has (gemma4's layers may have fewer)
        owner = key.rpartition(".")[0]
        return len(attention[owner.rpartition(".")[0]].parts) if owner.endswith("wqkv") else 2

    for name, w in names.fused(items, expected, gguf_io.cat_rows):
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if module is None or leaf not in module._parameters:
            raise QuickdraftError(f"the checkpoint does not match its config: unexpected {name}")
        expected = tuple(module._parameters[leaf].shape)
        if tuple(w.shape) != expected:
            raise QuickdraftError(f"the checkpoint does not match its config: {name} has shape {tuple(w.shape)}, "
                                  f"the config makes it {expected}")
        got = pending.setdefault(owner, {})
        got[leaf] = w
        if set(got) == {n for n, p in module._parameters.items() if p is not None}:
            _place(model, owner, module, pending.pop(owner), device, weights, source_types or {})
            if weights in quant.QUANTIZED:  # the float copies and conversion buffers just freed: give them back
                _return_freed_memory()  # (else glibc keeps them, and the peak grows with them)
    missing = [f"{m}.{n}" for m, mod in model.named_modules() for n, p in mod._parameters.items()
               if p is not None and p.is_meta]
    if missing and all(name.startswith("mtp.") for name in missing):  # a config that declares MTP layers its file
        model.mtp = None                                                # lacks (re-saved by transformers): no mtp
        missing = []
    if missing:
        raise QuickdraftError(f"the checkpoint does not match its config: missing {missing[:3]}")
    model.set_rotary(max_context, device)
    return model.eval().requires_grad_(False)


def _place(model: Transformer, owner: str, module, tensors: dict, device: torch.device, weights: str,
           source_types: dict) -> None:
    """Put one complete module's tensors on the device, as a quantized layer where the format asks. A tensor may
    be the file's rows (gguf.FileRows, StackedRows), read here and only here: on CUDA a matrix in 4-bit blocks goes
    to the GPU as its blocks, which become the int4 layer's codes and grids there (nothing fitted, never a float
    copy; likewise on a CPU without quickdraft's kernels); others are converted a block of rows at a time on the
    device."""
    from quickdraft.models.transformer import Linear

    kind = placement.linear_kind(weights, owner, source_types)  # the rule the memory plan counts by
    if kind != placement.FLOAT and isinstance(module, Linear):
        layer = _linear(kind, tensors["weight"], tensors.get("bias"), device)
        if layer is not None:
            parent, _, attr = owner.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, layer)
            return
    if kind != placement.FLOAT and isinstance(module, torch.nn.Embedding):
        table = tensors["weight"]
        if owner == "tok_embeddings" and model.output is None:  # tied: the head is a quantized copy, made first
            model.output = _linear(kind, table, None, device)
        if owner != "tok_embeddings" or model.output is not None:
            compact = embedding.table(placement.table_kind(weights, source_types.get(f"{owner}.weight"),
                                                           table.shape[1]), table)
            if compact is not None:
                setattr(model, owner, compact.to(device))
                return
    for leaf, w in tensors.items():
        module._parameters[leaf] = torch.nn.Parameter(_full(w).to(device), requires_grad=False)


def _linear(kind: str, weight, bias, device: torch.device):
    """kind's layer for weight on device (None where it stays float): from the file's 4-bit blocks themselves where
    they are that and the layer takes tinygemm's layout (int4.tinygemm_layout)."""
    cls = placement.linear_class(kind, *weight.shape, device)
    if cls is None:
        return None
    if kind == "int4" and getattr(weight, "four_bit", False) and int4.tinygemm_layout(device):
        weight = weight.grid()
    return cls(weight, bias, device)


def _full(w):
    return w.full() if hasattr(w, "full") else w  # the file's rows (gguf.FileRows, StackedRows)


def _check_format(fmt: str, device: torch.device, dtype: torch.dtype | None) -> None:

    if fmt not in quant.FORMATS:
        raise QuickdraftError(f"{{weights}} {fmt!r}: choose {', '.join(quant.FORMATS)}", "weights")
    if fmt in quant.QUANTIZED and (device.type not in ("cpu", "cuda") or dtype != torch.bfloat16):
        raise QuickdraftError(f"{{weights}} {fmt} runs with bfloat16 activations on the CPU or CUDA: set {{dtype}} "
                              "bfloat16, or use {weights} bf16", "weights", "dtype")


def _accumulate(update):
    done = 0

    def advance(n):
        nonlocal done
        done += n
        update(done)

    return advance
