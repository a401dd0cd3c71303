"""Gemma 3: Gemma 2's layers with q/k norms and without soft-capped attention; five sliding-window layers to one global
(GGUF files leave the pattern out: llama.cpp hard-codes it), the sliding layers' own rotary base (10,000 unless the
file says)."""

from quickdraft.config import RopeConfig
from quickdraft.weights.families.base import Family, windows
from quickdraft.weights.families.gemma2 import NAMES, gemma, scale


def _gguf(g, fields: dict) -> dict:
    out = dict(**gemma(fields["dim"], g.get("final_logit_softcapping", None)), attn_scale=scale(g, fields, 62),
               attn_softcap=None, **windows(g, fields["n_layers"], every=6))
    if out.get("layer_types"):
        out["rope_local"] = RopeConfig(theta=float(g.get("rope.freq_base_swa", 10000.0)))
    return out


def _hf(d: dict, fields: dict) -> dict:
    out = dict(**gemma(fields["dim"], d.get("final_logit_softcapping")),
               attn_scale=d.get("query_pre_attn_scalar", 256) ** -0.5)
    if not d.get("layer_types"):
        every = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        out["layer_types"] = tuple("sliding" if (i + 1) % every else "full" for i in range(fields["n_layers"]))
    params = d.get("rope_parameters")
    if not (isinstance(params, dict) and "full_attention" in params):  # not per layer type (transformers 4 keys)
        if d.get("rope_local_base_freq"):
            out["rope_local"] = RopeConfig(theta=float(d["rope_local_base_freq"]))
        elif not params:
            out["rope_local"] = RopeConfig(theta=10000.0)
    return out


FAMILY = Family("gemma3", hf_types=("gemma3_text",), hf_wrappers=("gemma3",), gguf=_gguf, hf=_hf,
                hf_fields={"qk_norm": True}, tied_by_default=True, hf_names=NAMES, one_centred_norms=True)
