"""Converted weights kept on disk: a model's second load in a quantized format reads back what the first
converted, with its config and tokenizer, instead of parsing the file and converting again.

A quantized load from a GGUF file spends most of its time dequantizing the file's blocks and fitting int4 grids;
reading back the kept conversion skips both (docs/performance.md, "Conversions kept on disk", has the
times).
One file per (model file, format), under <cache>/converted/ (`quickdraft pull`'s cache; $QUICKDRAFT_CACHE
moves both), named by the source's content (its sha256: a different file at the same path, even of the same size
and modification time, is another source) and quickdraft's conversion code. The digest of each tensor as written
(CRC-32) is kept in the file and checked when it is read back: a damaged copy is converted again, never used.
Hashing a source costs a read of it (about half a second a gigabyte); the digest is remembered in
<cache>/source-digests.json against the file's inode, size and modification and change times, which no rewrite of the
file leaves as they were, so a load pays it only for a file that changed. Small models (under MIN_BYTES, such as
the tests' tiny ones) convert in well under a second and are not kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os
import zlib
from pathlib import Path

import torch
from torch import nn

from quickdraft.config import ModelConfig
from quickdraft.models.transformer import Transformer
from quickdraft.tokenizer import BackendTokenizer, Tokenizer

log = logging.getLogger("quickdraft")

VERSION = 2  # 2: tensor digests
MIN_BYTES = 32 * 2**20  # sources smaller than this are converted on every load


def directory() -> Path:
    from quickdraft.weights import hub

    return hub.cache_dir() / "converted"


@functools.cache
def _code_digest() -> str:
    """The conversion code's digest: a change to it (formats, layouts, names) invalidates every kept file."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted([*root.glob("quant/**/*.py"), *root.glob("quant/csrc/*"), *root.glob("weights/*.py"),
                        root / "config.py", root / "tokenizer.py", root / "models" / "transformer.py"]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _source_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def location(path: Path, fmt: str, dtype: torch.dtype) -> Path | None:
    """Where the conversion of the model at path into fmt is kept; None for sources too small to keep."""
    from quickdraft.quant import vnni

    files = _source_files(path)
    size = sum(p.stat().st_size for p in files)
    if size < MIN_BYTES:
        return None
    stamp = [VERSION, _code_digest(), fmt, str(dtype), vnni.available(), [(p.name, content_digest(p)) for p in files]]
    digest = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    return directory() / f"{_stem(path, fmt)}-{digest}.pt"


def content_digest(file: Path) -> str:
    """The sha256 of a file's content, remembered in <cache>/source-digests.json against its (inode, size, mtime,
    ctime): any write to the file, or another file put in its place, changes one of them."""
    st = file.stat()
    stamp = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    memo_path = directory().parent / "source-digests.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    key = str(file.resolve())
    known = memo.get(key) if isinstance(memo, dict) else None
    if isinstance(known, dict) and known.get("stamp") == stamp:
        return known["sha256"]
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = {"stamp": stamp, "sha256": h.hexdigest()}
    with contextlib.suppress(OSError):  # only a missed shortcut
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".sources.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo), encoding="utf-8")
        os.replace(tmp, memo_path)
    return memo[key]["sha256"]


def _crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes."""
    t = tensor.detach().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy()) if t.numel() else 0


def _stem(path: Path, fmt: str) -> str:
    """The file name's part shared by every version of this model's conversion into fmt."""
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return f"{path.name}-{where}-{fmt}"


def _quantized_classes() -> dict[str, type]:
    from quickdraft.quant.embedding import BlockEmbedding, QuantEmbedding
    from quickdraft.quant.int4 import Int4Linear
    from quickdraft.quant.int8 import Int8Linear

    return {c.__name__: c for c in (Int4Linear, Int8Linear, BlockEmbedding, QuantEmbedding)}


def _plain(value):
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return value
    return int(value)  # ints and IntEnums (a GGUF block type)


def save(file: Path, model: Transformer, cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    """Keep a converted model (best effort: a failure to write is logged, and the load goes on)."""
    classes = tuple(_quantized_classes().values())
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, classes):
            attrs = {k: _plain(v) for k, v in vars(module).items()
                     if not k.startswith("_") and k != "training" and (v is None or isinstance(v, (int, float, str)))}
            modules[name] = {"class": type(module).__name__, "attrs": attrs}
    tok = {f.name: getattr(tokenizer, f.name) for f in dataclasses.fields(tokenizer) if f.name != "backend"}
    tok["eos_ids"] = sorted(tok["eos_ids"])
    tok["backend"] = tokenizer.backend.to_str()
    state = model.state_dict()
    blob = {"version": VERSION, "config": dataclasses.asdict(cfg), "modules": modules, "tokenizer": tok,
            "state": state, "crc32": {name: _crc(t) for name, t in state.items()}}
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, tmp)
        os.replace(tmp, file)
    except Exception as e:  # noqa: BLE001: disk full, no permission (torch's writer raises RuntimeError): not fatal
        log.warning("could not keep the converted weights in %s (%s): the next load converts again", file.parent, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return
    for old in file.parent.glob(f"{glob.escape(_stem_of(file))}-*.pt"):  # earlier versions of the same conversion
        if old != file:
            old.unlink(missing_ok=True)


def _stem_of(file: Path) -> str:
    return file.name.rsplit("-", 1)[0]


def load(file: Path, context_for) -> tuple[ModelConfig, Transformer, Tokenizer] | None:
    """(config, model on the CPU, tokenizer) from a kept conversion, the model's context as context_for(config)
    says; None where there is none, or it cannot be read (then it is removed, and the load converts)."""
    if not file.exists():
        return None
    try:
        blob = torch.load(file, map_location="cpu", weights_only=True)
        if blob.get("version") != VERSION:
            raise ValueError(f"version {blob.get('version')}")
        damaged = [name for name, t in blob["state"].items() if _crc(t) != blob["crc32"].get(name)]
        if damaged:
            raise ValueError(f"{len(damaged)} tensors differ from what was written, {damaged[0]} first")
        cfg = ModelConfig.from_dict(blob["config"])
        model = _model(blob, cfg, context_for(cfg))
        tok = dict(blob["tokenizer"])
        backend = BackendTokenizer.from_str(tok.pop("backend"))
        tokenizer = Tokenizer(backend=backend, **{**tok, "eos_ids": frozenset(tok["eos_ids"])})
    except Exception as e:  # noqa: BLE001: a damaged or foreign file is only a missed shortcut
        log.warning("the kept conversion %s is unreadable (%s: %s): converting again", file, type(e).__name__, e)
        file.unlink(missing_ok=True)
        return None
    return cfg, model, tokenizer


def _model(blob: dict, cfg: ModelConfig, context: int) -> Transformer:
    classes = _quantized_classes()
    with torch.device("meta"):
        model = Transformer(cfg, context)
    restored = set()
    for name, spec in blob["modules"].items():
        cls = classes[spec["class"]]
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.__dict__.update(spec["attrs"])
        if "qtype" in spec["attrs"]:  # a GGUF block type
            from gguf import GGMLQuantizationType

            module.qtype = GGMLQuantizationType(module.qtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
        restored.add(name)
    for key, tensor in blob["state"].items():
        owner, _, leaf = key.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf in module._parameters or (owner in restored and leaf == "bias"):
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        elif owner in restored or leaf in module._buffers:
            module._buffers[leaf] = tensor
        else:
            raise ValueError(f"unexpected tensor {key}")
    model.set_rotary(context)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensors missing: {left[:3]}")
    return model.eval().requires_grad_(False)
