"""The model families quickdraft runs, one file each (llama.py, qwen3_5.py, gemma4.py, ...): what a family's
checkpoints say of it beyond what every family shares, its tensor names, and the decoder switches it sets (base.Family).
Adding a family is adding its file here (and its tiny model to tests/families.py): every module of this folder that
defines FAMILY is one."""

from __future__ import annotations

import importlib
import pkgutil

from quickdraft.errors import QuickdraftError
from quickdraft.weights.families.base import Family

FAMILIES: dict[str, Family] = {}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
    _family = getattr(importlib.import_module(f"{__name__}.{_module}"), "FAMILY", None)
    if _family is not None:
        FAMILIES[_family.name] = _family


def get(name: str) -> Family:
    """The family of a ModelConfig's arch."""
    family = FAMILIES.get(name)
    if family is None:
        raise QuickdraftError(f"unsupported architecture {name!r}: quickdraft runs {', '.join(FAMILIES)}; use a model "
                              "of one of these families")
    return family


def by_gguf(arch: str) -> Family:
    """The family of a GGUF file's general.architecture."""
    found = next((f for f in FAMILIES.values() if f.file_arch == arch), None)
    if found is None:
        names = ", ".join(f.file_arch for f in FAMILIES.values() if f.file_arch)
        raise QuickdraftError(f"unsupported architecture {arch!r} in the GGUF file: quickdraft runs {names}")
    return found


def by_hf(model_type: str) -> tuple[Family, bool]:
    """The family of a config.json's model_type, and whether that names a multimodal wrapper holding the text model's
    config under text_config."""
    for f in FAMILIES.values():
        if model_type in f.hf_types or model_type in f.hf_builders:
            return f, False
        if model_type in f.hf_wrappers:
            return f, True
    known = sorted(t for f in FAMILIES.values() for t in (*f.hf_types, *f.hf_wrappers))
    raise QuickdraftError(f"unsupported architecture {model_type!r} in config.json: quickdraft runs "
                          f"{', '.join(FAMILIES)} ({', '.join(known)} as config.json names them)")
