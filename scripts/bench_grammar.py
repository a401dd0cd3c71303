#!/usr/bin/env python
"""Structured output on the default pair, side by side in one run.

1. The libraries: llguidance (ours) and, when installed, xgrammar, on the target's 151k-token vocabulary:
   tokenizer setup, schema compilation, and the time of one token mask (median and p99 over the tokens of
   the extraction answers).
2. A JSON-extraction prompt set (fields out of short texts into a schema), greedy, for: the constraint
   without speculation; speculation with the draft masked by the grammar (ours); speculation with a draft
   blind to the grammar (llama.cpp's way, --blind-draft). Decode tok/s (median of --runs after a warm-up),
   acceptance, tokens per round, the masks' share of decoding time, valid JSON, same output as plain.

Usage: .venv/bin/python scripts/bench_grammar.py [--runs 3] [-n 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from quickdraft.config import EngineConfig, SamplingParams, SpecConfig
from quickdraft.engine import Engine
from quickdraft.grammar import GrammarSpec
from quickdraft.spec.build import build_drafter
from quickdraft.weights import hub
from quickdraft.weights.loader import load_model

CTX = 1024
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "company", "role", "city", "year_joined", "skills"],
    "properties": {
        "name": {"type": "string"}, "company": {"type": "string"}, "role": {"type": "string"},
        "city": {"type": "string"}, "year_joined": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
}
TEXTS = {
    "engineer": "Maria Lopez joined Northwind Analytics in 2019 as a senior data engineer. She works from the "
                "Lisbon office and is known for her work with Python, Apache Spark and PostgreSQL.",
    "doctor": "Dr. Kenji Watanabe has been a cardiologist at Osaka General Hospital since 2011. Colleagues "
              "praise his skill in echocardiography, clinical research and teaching residents.",
    "chef": "In 2021 the Paris restaurant Le Jardin hired Amara Okafor as head chef; she brought expertise "
            "in West African cuisine, fermentation and menu design.",
    "teacher": "Tom Becker teaches mathematics at Riverside High School in Denver, where he started in 2015. "
               "He coaches the robotics club and writes tutorials on calculus and statistics.",
}
PROMPT = "Extract the person's details from this text as JSON with the fields name, company, role, city, " \
         "year_joined and skills.\n\nText: {text}"


def library_comparison(tokenizer, vocab: int, answers: list[list[int]]) -> list[dict]:
    rows = []
    import llguidance as llg

    t0 = time.perf_counter()
    lt = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=sorted(tokenizer.eos_ids))
    setup = time.perf_counter() - t0
    compile_s, times = [], []
    for ids in answers:
        t0 = time.perf_counter()
        m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(SCHEMA))
        m.compute_bitmask()  # the first mask builds the lexer: part of compiling
        compile_s.append(time.perf_counter() - t0)
        buf = torch.empty((vocab + 31) // 32, dtype=torch.int32)
        for t in ids:
            if not m.consume_token(t):
                break
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
            times.append(time.perf_counter() - t0)
    rows.append(_lib_row("llguidance " + llg.__version__, setup, compile_s, times))
    try:
        import xgrammar as xgr
    except ImportError:
        rows.append({"library": "xgrammar (not installed: pip install xgrammar to compare)"})
        return rows
    t0 = time.perf_counter()
    vocab_list = [tokenizer.backend.id_to_token(i) or "" for i in range(vocab)]
    info = xgr.TokenizerInfo(vocab_list, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                             stop_token_ids=sorted(tokenizer.eos_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_s, times = [], []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for ids in answers:
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
        matcher.fill_next_token_bitmask(bitmask)
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            if not matcher.accept_token(t):
                break
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
    rows.append(_lib_row("xgrammar " + xgr.__version__, setup, compile_s, times))
    return rows


def _lib_row(name, setup, compile_s, times):
    times = sorted(times)
    return {"library": name, "setup_s": setup, "compile_ms": 1000 * statistics.median(compile_s),
            "mask_us_median": 1e6 * statistics.median(times), "mask_us_p99": 1e6 * times[int(0.99 * (len(times) - 1))],
            "masks": len(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=96, help="most tokens per answer (the schema ends them sooner)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_context=CTX)
    target = load_model(hub.DEFAULT_TARGET, cfg, progress=False)
    tok = target.tokenizer
    prompts = {k: tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT.format(text=v)}]))
               for k, v in TEXTS.items()}
    spec = SpecConfig(draft_max=16)
    drafter = build_drafter(hub.DEFAULT_DRAFT, target, cfg, spec, CTX, progress=False)
    engines = {
        "constrained, no speculation": (Engine(target, CTX), spec),
        "constrained draft (ours)": (Engine(target, CTX, drafter, spec, "draft"), spec),
        "blind draft (llama.cpp's)": (Engine(target, CTX, drafter, spec, "draft"),
                                      SpecConfig(draft_max=16, constrain_draft=False)),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; target bf16, draft int4; greedy, "
          f"at most {args.n} tokens, median of {args.runs} runs after a warm-up", file=sys.stderr)
    grammar = GrammarSpec.json_schema(SCHEMA)
    results, answers = [], {}
    for pname, prompt in prompts.items():
        for cname, (engine, engine_spec) in engines.items():
            def once(n=args.n):
                events = list(engine.generate(prompt, SamplingParams(max_tokens=n), engine_spec,
                                              constraint=engine.constraint(grammar)))
                return [e.token for e in events if e.token is not None], events[-1]
            once(16)  # warm-up (kernels, policy timings)
            speeds = []
            for _ in range(args.runs):
                tokens, last = once()
                speeds.append(last.timings.decode_tok_s)
            text = tok.decode(tokens)
            try:
                json.loads(text)
                valid = True
            except json.JSONDecodeError:
                valid = False
            answers.setdefault(pname, tokens)
            s = last.spec
            results.append({
                "prompt": pname, "config": cname, "decode_tok_s": statistics.median(speeds), "runs": speeds,
                "tokens": len(tokens), "finish_reason": last.finish_reason, "valid_json": valid,
                "same_as_plain": tokens == answers[pname], "acceptance": s.acceptance_rate,
                "tokens_per_round": s.mean_accepted_length, "mask_share": s.mask_share, "mask_ms": 1000 * s.mask_s,
                "text": text,
            })
            print(f"  {pname:9} {cname:28} {statistics.median(speeds):6.2f} tok/s  {text[:70]!r}", file=sys.stderr)
    libs = library_comparison(tok, target.config.vocab_size, list(answers.values()))
    print(f"\n{'library':22} {'setup s':>8} {'compile ms':>10} {'mask us (median)':>16} {'p99':>8}")
    for r in libs:
        if "setup_s" in r:
            print(f"{r['library']:22} {r['setup_s']:8.2f} {r['compile_ms']:10.1f} {r['mask_us_median']:16.1f} "
                  f"{r['mask_us_p99']:8.1f}")
        else:
            print(r["library"])
    print(f"\n{'prompt':9} {'config':28} {'tok/s':>6} {'x none':>6} {'accept':>6} {'tok/round':>9} {'mask %':>6} "
          f"{'tokens':>6} valid same")
    for r in results:
        base = next(x for x in results if x["prompt"] == r["prompt"] and x["config"].startswith("constrained,"))
        print(f"{r['prompt']:9} {r['config']:28} {r['decode_tok_s']:6.2f} {r['decode_tok_s'] / base['decode_tok_s']:6.2f} "
              f"{100 * r['acceptance']:5.0f}% {r['tokens_per_round']:9.2f} {100 * r['mask_share']:5.1f}% "
              f"{r['tokens']:6} {'yes' if r['valid_json'] else 'NO':5} {'yes' if r['same_as_plain'] else 'NO'}")
    print(f"\nmedians over prompts:")
    for cname in engines:
        rows = [r for r in results if r["config"] == cname]
        print(f"  {cname:28} {statistics.median(r['decode_tok_s'] for r in rows):6.2f} tok/s, acceptance "
              f"{100 * statistics.median(r['acceptance'] for r in rows):.0f}%")
    if args.json:
        args.json.write_text(json.dumps({"libraries": libs, "results": results}, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
