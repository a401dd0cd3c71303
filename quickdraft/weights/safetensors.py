"""Hugging Face model directories: config.json + *.safetensors (sharded too)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from quickdraft.config import ModelConfig
from quickdraft.errors import QuickdraftError, read_json
from quickdraft.weights import families
from quickdraft.weights.hf_config import model_config
from quickdraft.weights.names import hf_to_model


def read_config(path: Path) -> ModelConfig:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise QuickdraftError(f"{path} has no config.json: give a Hugging Face model directory or a .gguf file")
    return model_config(read_json(cfg_path))


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuickdraftError(f"{path} has no *.safetensors files: quickdraft reads safetensors weights only")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise QuickdraftError(f"{path} lacks the shards {', '.join(missing)} named by its index; re-download them")
    return files


def shard_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in shard_files(path))


def read_tensors(path: Path, cfg: ModelConfig, dtype: torch.dtype, progress=None):
    """Every tensor the model uses in `dtype`, one at a time: yields (model name, tensor). A family whose norms' weights
    are centred on 0 (scaling by 1 + w: Family.one_centred_norms) has the 1 folded into w here, as llama.cpp's converter
    does, so that every norm is x / rms(x) * w (qwen3.5's linear layers' output norm is not one of them)."""
    centred = families.get(cfg.arch).one_centred_norms
    for file in shard_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = hf_to_model(key, cfg.arch)
                if name is None or (cfg.tie_embeddings and name == "output.weight"):
                    continue
                if name.startswith("mtp.") and not cfg.mtp_layers:  # MTP tensors a config does not declare
                    continue
                t = f.get_tensor(key)
                if centred and name.endswith("norm.weight") and not name.endswith("out_norm.weight"):
                    t = t.float() + 1
                yield name, t.to(dtype) if t.is_floating_point() else t  # ids stay ids (an assistant's ordering)
                if progress is not None:
                    progress(t.numel() * t.element_size())
