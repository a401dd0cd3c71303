"""Gemma 2: GeGLU (tanh GELU), embeddings scaled by sqrt(dim), norms around attention and the FFN ("sandwich") stored
centred on 0 in config.json, soft-capped attention and output logits, alternating sliding (4096) and full layers. What
the Gemma families share is here (gemma3.py and gemma4.py use it)."""

import math

from quickdraft.weights.families.base import Family, windows

# the gemmas' names in config.json where they differ from the shared ones: the norm after attention is the sandwich
# norm (llama's post_attention_layernorm is the norm before the FFN; gemma's is pre_feedforward_layernorm)
NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight"}


def gemma(dim: int, final_softcap) -> dict:
    """What every Gemma computes differently from llama."""
    return dict(activation="gelu_tanh", embed_scale=math.sqrt(dim), sandwich_norms=True,
                final_softcap=final_softcap or None)


def scale(g_or_d, fields: dict, wide: int) -> float:
    """Gemma 2 and 3's attention scale from a GGUF file: 1 / sqrt(head size), but 1 / sqrt(dim / heads) for the
    model `wide` layers deep (the 27B), as llama.cpp hard-codes it."""
    layers, dim, heads = fields["n_layers"], fields["dim"], fields["n_heads"]
    return 1 / math.sqrt(dim / heads if layers == wide else fields["head_dim"])


def _gguf(g, fields: dict) -> dict:
    return dict(**gemma(fields["dim"], g.get("final_logit_softcapping", None)), attn_scale=scale(g, fields, 46),
                attn_softcap=g.get("attn_logit_softcapping", None), **windows(g, fields["n_layers"], 4096, 2))


def _hf(d: dict, fields: dict) -> dict:
    out = dict(**gemma(fields["dim"], d.get("final_logit_softcapping")),
               attn_scale=d.get("query_pre_attn_scalar", 256) ** -0.5, attn_softcap=d.get("attn_logit_softcapping"))
    if not d.get("layer_types"):
        out["layer_types"] = tuple("sliding" if i % 2 == 0 else "full" for i in range(fields["n_layers"]))
    return out


FAMILY = Family("gemma2", hf_types=("gemma2",), gguf=_gguf, hf=_hf, tied_by_default=True, hf_names=NAMES,
                one_centred_norms=True)
