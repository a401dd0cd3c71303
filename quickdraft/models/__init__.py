"""The decoders, as pure tensor math: transformer.py (every family), assistant.py (Gemma 4's assistant drafter)."""

from __future__ import annotations


def build(cfg, max_context: int | None = None):
    """The model cfg (a ModelConfig) describes: a Transformer, or a Gemma 4 assistant (models/assistant.py). (Its
    imports are here: config.py imports models.rope, which runs this package first.)"""
    from quickdraft.models.assistant import Assistant
    from quickdraft.models.transformer import Transformer

    if cfg.assistant_backbone:
        return Assistant(cfg, max_context)
    return Transformer(cfg, max_context)
