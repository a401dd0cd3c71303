"""Llama 2 / 3.x, TinyLlama, SmolLM (and Mistral's GGUF files, which llama.cpp writes as llama): the shared keys and
names alone. llama.cpp's converter permutes the rows of wq and wk for its interleaved rotary; the loader puts them back
(weights/names.unpermute_rotary)."""

from quickdraft.weights.families.base import Family

FAMILY = Family("llama", hf_types=("llama",), rotary_permuted=True)
