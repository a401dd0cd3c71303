#!/usr/bin/env python
"""Perplexity of each runtime weight format against llama.cpp's own on the same GGUF file, text and tokens, in one
run: llama.cpp (the PyPI package llama-cpp-python: not a quickdraft dependency, `.venv/bin/pip install
llama-cpp-python` compiles it for this CPU) computes the logits of each window, quickdraft's `perplexity` the same
windows (llama.cpp's method: windows of --ctx tokens, the second half of each scored) in bf16, mixed, int8 and int4.

Usage: .venv/bin/python scripts/bench_ppl_llamacpp.py [-m ALIAS_OR_GGUF ...] [--ctx 128] [--formats bf16,mixed,int4]
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from quickdraft.config import EngineConfig  # noqa: E402
from quickdraft.perplexity import perplexity, window_nll  # noqa: E402
from quickdraft.tools.quality import TEXT as QUALITY_TEXT  # noqa: E402
from quickdraft.weights.loader import load_model, resolve  # noqa: E402
from quickdraft.tools.runs import machine

TEXT = QUALITY_TEXT


def llama_cpp_ppl(path: Path, tokens: list[int], ctx: int, bos: int | None) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=ctx, n_batch=ctx, n_threads=2)
    total = scored = 0
    for c in range(len(tokens) // ctx):
        window = tokens[c * ctx:(c + 1) * ctx]
        if bos is not None:
            window[0] = bos
        llm.reset()
        llm.eval(window)
        logits = torch.tensor(np.array(llm.scores[:ctx]))
        total += float(window_nll(logits, torch.tensor(window), ctx // 2))
        scored += ctx - ctx // 2 - 1
    del llm
    gc.collect()
    return math.exp(total / scored)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--formats", default="bf16,mixed,int8,int4")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    text = TEXT.read_text(encoding="utf-8")
    print("| model | tokens | llama.cpp | " + " | ".join(f"quickdraft {f} (vs llama.cpp)" for f in
                                                        args.formats.split(",")) + " |")
    print("|---" * (3 + len(args.formats.split(","))) + "|")
    for source in args.model:
        config = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", weight_cache=False)
        lm = load_model(source, config, progress=False)
        tokens = lm.tokenizer.encode(text)  # with BOS where the model adds one, as llama-perplexity
        bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
        del lm
        gc.collect()
        reference = llama_cpp_ppl(resolve(source), tokens, args.ctx, bos)
        cells = []
        for fmt in args.formats.split(","):
            m = load_model(source, EngineConfig(device="cpu", dtype="bfloat16", weights=fmt), progress=False)
            ppl = perplexity(m.model, tokens, args.ctx, bos).ppl
            cells.append(f"{ppl:.3f} ({100 * (ppl / reference - 1):+.1f}%)")
            del m
            gc.collect()
        print(f"| {source} | {len(tokens)} | {reference:.3f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
