#!/usr/bin/env python
"""The family table: for each tiny random model of tests/families.py, the largest |logit difference| against HF
transformers in float32 (a full pass, and a prefill of 3 then one token at a time through the cache) when quickdraft
loads its Hugging Face directory and llama.cpp's own GGUF conversion of it (f32; q8_0 as the largest difference
against the logits' own range, with the share of next tokens that agree); then whether greedy speculative output
(a noisy draft, fixed k=4 and adaptive n-gram+draft) equals plain output in bf16, int8 and mixed. The same checks
as tests/test_families.py (which asserts them), printed. With llama-cpp-python installed (`.venv/bin/pip install
llama-cpp-python`, which compiles llama.cpp), one more column: quickdraft against llama.cpp itself running the same
f32 and q8_0 files. Needs the test extras (transformers; llama.cpp's source comes from PyPI on first use).

Usage: .venv/bin/python -m tests.families_table [FAMILY ...]   (a report over the tests' tiny models)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.weights.loader import load_model
from tests import llamacpp
from tests.families import CONVERTED, FAMILIES, TOKENS, save, tiny_model
from tests.helpers import drafter

try:
    from llama_cpp import Llama as LLAMA
except ImportError:
    LLAMA = None
from tests.test_families import NOISE, fp32, forward, hf_logits


def logit_row(name: str, hf, d: Path) -> list[str]:
    want = hf_logits(hf, TOKENS)

    def diffs(lm) -> str:
        full, cached = (float((forward(lm, TOKENS, p) - want).abs().max()) for p in (None, 3))
        return f"{full:.1e} / {cached:.1e}"

    cells = [diffs(load_model(str(d / "hf"), fp32(name), progress=False))]
    if name not in CONVERTED:
        return cells + ["(no GGUF window)", "-"] + (["-"] if LLAMA else [])
    files = [llamacpp.convert(d / "hf", d / f"{t}.gguf", t) for t in ("f32", "q8_0")]
    f32, q8 = (load_model(str(f), fp32(name), progress=False) for f in files)
    got = forward(q8, TOKENS)
    rel = float((got - want).abs().max() / want.abs().max())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    cells += [diffs(f32), f"{rel:.3f}, {agree:.0%} same"]
    if LLAMA:
        ours = (forward(f32, TOKENS), got)
        theirs = (llama_logits(f) for f in files)
        cells.append(" / ".join(f"{float((a - b).abs().max()):.1e}" for a, b in zip(ours, theirs)))
    return cells


def llama_logits(path: Path) -> torch.Tensor:
    """llama.cpp's own logits for TOKENS from a GGUF file (float32 throughout on the CPU)."""
    import numpy as np

    llm = LLAMA(model_path=str(path), logits_all=True, verbose=False, n_ctx=64, n_threads=2)
    llm.eval(TOKENS)
    return torch.tensor(np.array(llm.scores[: len(TOKENS)]))


def speculation_row(name: str, hf, d: Path) -> list[str]:
    noisy = tiny_model(name)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(NOISE * p.std() * torch.randn_like(p))
    save(noisy, d / "draft")
    cells = []
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    for weights in ("bf16", "int8", "mixed"):
        config = EngineConfig(device="cpu", dtype="bfloat16", weights=weights, max_context=256)
        target = load_model(str(d / "hf"), config, progress=False)
        draft = load_model(str(d / "draft"), config, progress=False)
        plain = [e.token for e in Engine(target, 256).generate(TOKENS, params) if e.token is not None]
        same, accepted = True, 0
        for kind, spec in (("draft", SpeculationConfig(draft_max=4, adaptive=False)), ("combined", SpeculationConfig())):
            events = list(Engine(target, 256, drafter(kind, target, draft), spec).generate(TOKENS, params))
            same &= [e.token for e in events if e.token is not None] == plain
            accepted += events[-1].stats.draft_n_accepted
        cells.append(f"{'yes' if same else 'NO'} ({accepted} kept)")
    return cells


def main() -> int:
    names = sys.argv[1:] or FAMILIES
    head = ["family", "HF dir: full / cached", "llama.cpp f32 GGUF", "q8_0 GGUF: rel, next", "spec bf16", "spec int8",
            "spec mixed"] + (["llama.cpp itself: f32 / q8_0"] if LLAMA else [])
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            hf = tiny_model(name)
            save(hf, d / "hf")
            logits = logit_row(name, hf, d)
            rows.append([name] + logits[:3] + speculation_row(name, hf, d) + logits[3:])
        print(" | ".join(rows[-1]), file=sys.stderr)
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
