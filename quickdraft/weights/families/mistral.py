"""Mistral, Ministral, Mistral Small: llama's layers, every one sliding-window where config.json sets a window (their
GGUF files are llama's: llama.cpp's llama has no window)."""

from quickdraft.weights.families.base import Family, windows


def _gguf(g, fields: dict) -> dict:
    return windows(g, fields["n_layers"])


def _hf(d: dict, fields: dict) -> dict:
    if not d.get("layer_types") and d.get("sliding_window"):
        return {"layer_types": ("sliding",) * fields["n_layers"]}
    return {}


FAMILY = Family("mistral", hf_types=("mistral", "ministral"), gguf=_gguf, hf=_hf)
