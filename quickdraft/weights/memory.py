"""The memory plan: what a target and its draft will take on a device, worked out before any weight is read.

Each model's weights are counted in the runtime format each of its modules will have (the loader's own rules:
`quant.for_source` per module, the kernels' shape rules, compact embedding tables, a tied head's quantized copy),
from the file's tensor list and config alone; then its KV cache for the context, the activations of the largest
pass (a prefill of the whole context), and on CUDA the context PyTorch and cuBLAS create. Against the device's
free memory (or a stated size): a plan that does not fit is refused with the numbers; above TIGHT of the device
the load goes on with a warning that names what to lower (speculation slows down when memory is that tight:
the allocator has no room for a draft's passes and the cache's growth). quickdraft never offloads a layer to
the host: a model is on its device in full, or it is not loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models import build
from quickdraft.models.transformer import Linear
from quickdraft.quant import placement
from quickdraft.runtime.kv_cache import HISTORY

TIGHT = 0.90  # of the device's memory: above it, a warning
CUDA_CONTEXT = 600 * 2**20  # the CUDA context, cuBLAS workspaces and the caching allocator's slack (an estimate)
GIB = 2**30
HINTS = ("context", "draft_weights", "weights")  # the settings a plan that does not fit names


@dataclass
class Item:
    what: str  # e.g. "target weights"
    nbytes: int
    detail: str = ""


@dataclass
class MemoryPlan:
    device: str
    capacity: int  # the device's memory in bytes
    free: int  # of which free now (or the stated size)
    items: list[Item] = field(default_factory=list)
    device_type: str = "cpu"  # cpu | cuda
    formats: dict = field(default_factory=dict)  # role -> the weight format planned

    @property
    def used(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.used <= self.free

    @property
    def share(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0

    def lines(self) -> list[str]:
        rows = [f"  {i.what:<22} {i.nbytes / GIB:7.2f} GiB  {i.detail}" for i in self.items]
        rows.append(f"  {'total':<22} {self.used / GIB:7.2f} GiB  of {self.capacity / GIB:.1f} GiB "
                    f"({100 * self.share:.0f}%), {self.free / GIB:.1f} GiB free")
        return rows

    def largest(self) -> str:
        """What to lower, the parts of the plan that can be."""
        kv = sum(i.nbytes for i in self.items if "KV cache" in i.what)
        draft = sum(i.nbytes for i in self.items if i.what.startswith("draft"))
        hints = [f"the context ({{context}}: the KV caches take {kv / GIB:.1f} GiB)"] if kv else []
        if draft:
            fmt = self.formats.get("draft")
            hints.append(f"the draft ({draft / GIB:.1f} GiB: " + ("a smaller one, or none" if fmt == "int4" else
                                                                   "{draft_weights} int4, a smaller one, or none") + ")")
        if self.formats.get("target") not in (None, "int4"):
            hints.append(f"the target's format ({{weights}} int4, from {self.formats['target']})")
        return "; ".join(hints) or "nothing: the models alone are larger than the device"

    def refusal(self) -> QuickdraftError:
        return QuickdraftError(f"the models do not fit on {self.device}: they need {self.used / GIB:.1f} GiB and "
                f"{self.free / GIB:.1f} GiB of {self.capacity / GIB:.1f} GiB is free ("
                + ", ".join(f"{i.what} {i.nbytes / GIB:.1f}" for i in self.items)
                + f" GiB); lower {self.largest()}", *HINTS)

    def warning(self) -> QuickdraftError | None:
        if self.share <= TIGHT:
            return None
        return QuickdraftError(f"the models take {100 * self.share:.0f}% of {self.device}'s {self.capacity / GIB:.1f} "
                               f"GiB (above {TIGHT:.0%}, speculation slows down: no room for its passes); lower "
                               f"{self.largest()}", *HINTS)


@functools.lru_cache(maxsize=8)
def _skeleton(cfg: ModelConfig):
    """The model of cfg on the meta device (no memory): its modules, layouts and shapes, built once per config."""
    with torch.device("meta"):
        return build(cfg, 16)


def weight_bytes(cfg: ModelConfig, fmt: str, device: torch.device, types: dict | None = None,
                 file_bytes: dict | None = None, dtype_size: int = 2) -> tuple[int, str]:
    """(bytes, how) of a model's weights in format fmt (concrete: bf16, int8, int4 or mixed) on device, each module
    placed by the loader's own rule (quant/placement.py). types: the file's tensor type by model name (GGUF), None
    for a float checkpoint; file_bytes: the file's bytes by model name (a block-format table keeps them)."""
    types, file_bytes = types or {}, file_bytes or {}
    model = _skeleton(cfg)
    total, counts = 0, {}
    for owner, module in model.named_modules():
        if isinstance(module, Linear):
            n, k = module.weight.shape
            kind, size = placement.linear_bytes(placement.linear_kind(fmt, owner, types), n, k, device, dtype_size)
            counts[kind] = counts.get(kind, 0) + n * k
            total += size + (module.bias.numel() * 2 if module.bias is not None else 0)
        elif isinstance(module, torch.nn.Embedding):
            v, d = module.weight.shape
            table = placement.table_kind(fmt, types.get(f"{owner}.weight"), d)
            if owner == "tok_embeddings" and model.output is None:  # tied: the head is a quantized copy of it
                kind, size = placement.linear_bytes(placement.linear_kind(fmt, owner, types), v, d, device, dtype_size)
                counts[kind] = counts.get(kind, 0) + v * d
                total += size if kind != placement.FLOAT else 0
                table = table if kind != placement.FLOAT else placement.FLOAT  # a float head keeps a float table
            total += placement.table_bytes(table, v, d, file_bytes.get(f"{owner}.weight"), dtype_size)
        else:
            total += sum(p.numel() * dtype_size for p in module.parameters(recurse=False))
    share = sum(counts.values()) or 1
    how = ", ".join(f"{100 * c / share:.0f}% {k}" for k, c in sorted(counts.items(), key=lambda kv: -kv[1]))
    return total, f"{fmt}: linear layers {how}"


def linear_weights(cfg: ModelConfig, fmt: str, device: torch.device, types: dict | None = None) -> dict[str, int]:
    """How many weights of the model's linear layers (a tied head's copy included) take each concrete kind (int4,
    int8, bf16) in format fmt: what a decoding step reads of each kernel's weights (weights/machine.py)."""
    types, model, counts = types or {}, _skeleton(cfg), {}
    for owner, module in model.named_modules():
        shape = module.weight.shape if isinstance(module, Linear) else (
            module.weight.shape if owner == "tok_embeddings" and model.output is None else None)
        if shape is not None:
            kind, _ = placement.linear_bytes(placement.linear_kind(fmt, owner, types), *shape, device)
            counts[kind] = counts.get(kind, 0) + shape[0] * shape[1]
    return counts


def kv_bytes(cfg: ModelConfig, capacity: int, dtype_size: int = 2) -> int:
    """The KV cache of `capacity` positions (runtime/kv_cache.py: every layer that owns one, at full capacity), and a
    hybrid's recurrent states: each linear layer's HISTORY + 2 preallocated state slots and its convolution's inputs."""
    model = _skeleton(cfg)
    kv = sum(2 * heads * dim * capacity * dtype_size for i, (heads, dim, source) in enumerate(model.kv_layout())
             if source == i)
    states = [s for s in model.state_layout() or [] if s is not None]
    return kv + sum((HISTORY + 2) * heads * k_dim * v_dim * 4 + (kernel - 1) * conv * dtype_size
                    for conv, kernel, heads, k_dim, v_dim in states)


PASS_ROWS = 64  # the most rows of a pass: a prefill runs in passes of this many (weights/loader.LoadedModel.chunk)


def activation_bytes(cfg: ModelConfig, context: int, rows: int = PASS_ROWS, width: int = 17) -> int:
    """The largest pass's activations, estimated: a prefill pass of `rows` tokens at the end of `context` positions
    (the hidden states, q/k/v, the FFN's gate, up and product in bf16, each head's float32 scores over the context)
    and a verification's float32 logits."""
    q = cfg.n_heads * cfg.head_dim
    kv = 2 * cfg.n_kv_heads * cfg.head_dim
    per_row = 2 * (4 * cfg.dim + q + kv + 3 * max(cfg.ffn_dim, cfg.ffn_dim_shared or 0))
    return rows * per_row + rows * cfg.n_heads * context * 4 + 2 * width * cfg.vocab_size * 4


@dataclass
class ModelSpec:
    """What the plan needs of one model: its config, its file's tensor types and bytes, its concrete format."""

    role: str  # target | draft
    name: str
    cfg: ModelConfig
    fmt: str
    types: dict | None = None
    file_bytes: dict | None = None


def spec_from_source(role: str, source: str, fmt: str) -> ModelSpec:
    """A model's spec from its file's metadata and tensor list (nothing else is read)."""
    from quickdraft.weights import gguf as gguf_io, safetensors as st_io
    from quickdraft.weights.loader import resolve

    path = resolve(source)
    if path.is_dir():
        return ModelSpec(role, Path(source).name, st_io.read_config(path), fmt)
    reader = gguf_io.open_gguf(path)
    cfg = gguf_io.config_from_metadata(gguf_io.metadata(reader), reader)
    gguf_io.check_tensor_types(reader)  # (as the loader does, before a tensor's name is looked at)
    types, nbytes = {}, {}
    for t in reader.tensors:
        got = gguf_io.gguf_model_names(t.name, cfg)
        for name in got:  # a MoE layer's stacked experts: a share each
            types[name], nbytes[name] = t.tensor_type, int(t.n_bytes) // len(got)
    return ModelSpec(role, Path(source).name, cfg, fmt, types, nbytes)


def plan(models: list[ModelSpec], context: int, device: torch.device, capacity: int | None = None,
         free: int | None = None, extra: list[Item] = ()) -> MemoryPlan:
    """The plan of `models` (the target first) with caches of `context` positions on device, and `extra` items before
    the activations (what a drafter holds of its own: speculative/base.Drafter.planned; an item "activations" there
    is a pass that runs apart from the target's, the larger counted); capacity and free default to the device's own
    (CUDA: what the driver reports now)."""
    device = torch.device(device)
    measured = capacity is None and device.type == "cuda"
    if capacity is None:
        if device.type == "cuda":
            free_now, capacity = torch.cuda.mem_get_info(device)  # the CUDA context exists now: out of free_now
            free = free_now if free is None else free
        else:
            capacity = host_memory()
    free = capacity if free is None else free
    out = MemoryPlan(_name(device), capacity, free, device_type=device.type)
    for m in models:
        out.formats[m.role] = m.fmt
        weights, how = weight_bytes(m.cfg, m.fmt, device, m.types, m.file_bytes)
        out.items.append(Item(f"{m.role} weights", weights, f"{m.name}, {how}"))
        out.items.append(Item(f"{m.role} KV cache", kv_bytes(m.cfg, context), f"{context} positions, bf16"))
    out.items += [i for i in extra if i.what != "activations"]
    passes = [activation_bytes(m.cfg, context) for m in models] + [i.nbytes for i in extra if i.what == "activations"]
    if passes:
        out.items.append(Item("activations", max(passes), f"a prefill of {context} tokens, estimated"))
    if device.type == "cuda" and not measured:  # a measured free memory has the context taken out already
        out.items.append(Item("CUDA context", CUDA_CONTEXT, "PyTorch, cuBLAS, allocator slack (estimated)"))
    return out


def check(plan_: MemoryPlan, warn=None) -> None:
    """Refuse a plan that does not fit (QuickdraftError with the numbers); warn(QuickdraftError) above TIGHT."""
    if not plan_.fits:
        raise plan_.refusal()
    problem = plan_.warning()
    if problem is not None and warn is not None:
        warn(problem)


def _name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def host_memory() -> int:
    """The memory this process may use, in bytes: the machine's, or a cgroup's limit where it is lower (a container's
    --memory: cgroup v2 memory.max, v1 memory.limit_in_bytes); 0 where neither can be read."""
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit, encoding="utf-8").read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 2**62):
            return int(text)
    return total


def parse_size(text: str) -> int:
    """'24GB', '24 GiB', '24G', '16000MB' -> bytes (GB and GiB alike: 2**30, as device memory is quoted)."""
    t = text.strip().upper().replace(" ", "").removesuffix("B").removesuffix("I")
    scale = {"G": 2**30, "M": 2**20, "T": 2**40}.get(t[-1:], None)
    try:
        return int(float(t[:-1] if scale else t) * (scale or 2**30))
    except ValueError:
        raise QuickdraftError(f"memory size {text!r}: write it like 24GB or 16000MB") from None
