"""Rotary position embeddings: the frequencies of each scaling scheme, and the cos/sin tables a model precomputes.

Every scheme is "neox" style here (the two halves of the rotated dimensions pair up, as Hugging Face's rotate_half
does); llama-arch GGUF files, whose converter permutes the Q/K rows for interleaved rotation, are unpermuted at load.

- default: inv_freq[i] = theta^(-2i/d) over the rotated dimensions d (all of the head, or rotary_dim: Phi's partial
  rotary, where the rest of the head passes through);
- linear: inv_freq / factor;
- llama3 (Llama 3.1+): low frequencies divided by factor, high ones kept, a smooth ramp between;
- longrope (Phi-3 "su"): inv_freq divided by per-frequency factors, short ones within the original context and long
  ones beyond it, cos and sin scaled by attention_factor. Hugging Face picks short or long at every call from the
  current length; a cached sequence's positions must not change meaning, so here (as in llama.cpp) the choice is
  made once, from the context the model is loaded with;
- proportional (Gemma 4 global layers): only the first `fraction` of the frequencies rotate, exponents over the
  whole head;
- freq_factors (a GGUF file's rope_freqs tensor: Llama 3's scaling precomputed, Gemma 4's proportional mask): the
  divisor of each frequency, applied last.
"""

from __future__ import annotations

import math

import torch

from quickdraft.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int, context: int) -> torch.Tensor:
    """The rotation frequencies (rotated dims / 2,), float32, for a model loaded with `context` positions."""
    dim = rope.rotary_dim or head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    freq = 1.0 / (rope.theta ** exponents)
    if rope.scaling == "linear":
        freq = freq / rope.factor
    elif rope.scaling == "llama3":
        freq = _llama3(freq, rope)
    elif rope.scaling == "longrope":
        factors = rope.long_factors if context > rope.original_context and rope.long_factors else rope.short_factors
        if factors:
            freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** exponents)
    elif rope.scaling == "proportional":
        keep = int(rope.fraction * dim // 2)
        freq = torch.cat([freq[:keep], torch.zeros(dim // 2 - keep)])
    if rope.freq_factors:
        freq = freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return freq


def _llama3(freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """As transformers' _compute_llama3_parameters."""
    low_wavelen = rope.original_context / rope.low_freq_factor
    high_wavelen = rope.original_context / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def tables(rope: RopeConfig, head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..length-1, each (length, rotated dims), float32."""
    freq = inv_freq(rope, head_dim, length)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * rope.attention_factor, angles.sin() * rope.attention_factor
