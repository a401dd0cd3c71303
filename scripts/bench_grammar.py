#!/usr/bin/env python
"""Structured output on the default pair, side by side in one run.

1. The libraries: llguidance (ours) and, when installed, xgrammar, on the target's 151k-token vocabulary:
   tokenizer setup, schema compilation, and the time of one token mask (median and p99 over the tokens of
   the extraction answers).
2. A JSON-extraction prompt set (fields out of short texts into a schema), greedy, for: the constraint
   without speculation; speculation with the draft masked by the grammar (ours); speculation with a draft
   blind to the grammar (llama.cpp's way, --blind-draft); each with the adaptive policy and at fixed k = 4
   (where the policy's choices cannot differ). Decode tok/s (median of --runs after a warm-up, the
   configurations interleaved), acceptance, tokens per round, the masks' share of decoding time, valid
   JSON (jsonschema), same output as without speculation.
3. Validity: --samples seeded samples at temperature 1 with speculation on, each checked with jsonschema.

Usage: .venv/bin/python scripts/bench_grammar.py [--runs 3] [-n 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import torch

import quickdraft
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.grammar import Grammar
from quickdraft.weights import hub
from quickdraft.tools.runs import Figures, machine, rotated

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
# Two prompts name the schema's fields, two leave them to the model, whose own keys the schema then overrides
# (where a draft blind to the grammar guesses the model's keys and is rejected).
LISTED = "Extract the person's details from this text as JSON with the fields name, company, role, city, " \
         "year_joined and skills.\n\nText: {text}"
BARE = "Extract the person's details from this text as JSON.\n\nText: {text}"
PROMPTS = {"engineer": LISTED, "doctor": LISTED, "chef": BARE, "teacher": BARE}


def library_comparison(tokenizer, vocab: int, answers: list[list[int]]) -> list[dict]:
    rows = []
    import llguidance as llg

    t0 = time.perf_counter()
    lt = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=sorted(tokenizer.eos_ids))
    setup = time.perf_counter() - t0
    timed = Figures()  # seconds by "compile" and "mask"
    for ids in answers:
        t0 = time.perf_counter()
        m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(SCHEMA))
        m.compute_bitmask()  # the first mask builds the lexer: part of compiling
        timed.add("compile", time.perf_counter() - t0)
        buf = torch.empty((vocab + 31) // 32, dtype=torch.int32)
        for t in ids:
            if not m.consume_token(t):
                break
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
            timed.add("mask", time.perf_counter() - t0)
    rows.append(_lib_row("llguidance " + importlib.metadata.version("llguidance"), setup, timed))
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
    timed = Figures()  # seconds by "compile" and "mask"
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for ids in answers:
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True))
        matcher.fill_next_token_bitmask(bitmask)
        timed.add("compile", time.perf_counter() - t0)
        for t in ids:
            if not matcher.accept_token(t):
                break
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            timed.add("mask", time.perf_counter() - t0)
    rows.append(_lib_row("xgrammar " + importlib.metadata.version("xgrammar"), setup, timed))
    return rows


def sample_validity(engine, prompts, grammar, args) -> dict:
    """Seeded samples at temperature 1: each one that ends "stop" must be valid against the schema."""
    complete = valid = length = drafted = accepted = 0
    names = list(prompts)
    for seed in range(args.samples):
        prompt = prompts[names[seed % len(names)]]
        events = list(engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=args.n * 2, seed=seed),
                                      constraint=engine.constraint(grammar)))
        final, text = events[-1], "".join(e.text for e in events)
        drafted, accepted = drafted + final.stats.draft_n, accepted + final.stats.draft_n_accepted
        if final.finish_reason != "stop":
            length += 1
            continue
        complete += 1
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            print(f"  INVALID (seed {seed}): {e}: {text!r}", file=sys.stderr)
    return {"samples": args.samples, "complete": complete, "valid": valid, "length": length,
            "acceptance": accepted / drafted if drafted else 0.0}


def _lib_row(name, setup, timed: Figures):
    if not timed.samples.get("mask"):
        return {"library": f"{name}: refused the answers' tokens (no masks timed)"}
    times = sorted(timed.samples["mask"])
    return {"library": name, "setup_s": setup, "compile_ms": 1000 * timed.median("compile"),
            "mask_us_median": 1e6 * timed.median("mask"), "mask_us_p99": 1e6 * times[int(0.99 * (len(times) - 1))],
            "masks": len(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-n", type=int, default=96, help="most tokens per answer (the schema ends them sooner)")
    ap.add_argument("--samples", type=int, default=16,
                    help="seeded samples at temperature 1 (speculation on) checked against the schema")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)  # figures are this machine kind's
    llm = quickdraft.load(hub.DEFAULT_TARGET, "none", device="cpu", dtype="bfloat16", context=CTX, progress=False)
    target, tok = llm.target, llm.tokenizer
    prompts = {k: llm.chat_prompt([{"role": "user", "content": PROMPTS[k].format(text=v)}]) for k, v in TEXTS.items()}
    spec = SpeculationConfig(draft_max=16)
    fixed = SpeculationConfig(draft_max=4, adaptive=False)
    draft = hub.DEFAULT_DRAFT
    configs = {  # name: (engine, speculation settings); each engine keeps its own policy
        "no speculation": (llm.engine, spec),
        "masked draft, adaptive": (llm.engine_for(draft, spec), spec),
        "blind draft, adaptive": (llm.engine_for(draft, spec), replace(spec, constrain_draft=False)),
        "masked draft, k=4": (llm.engine_for(draft, fixed), fixed),
        "blind draft, k=4": (llm.engine_for(draft, fixed), replace(fixed, constrain_draft=False)),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; target bf16, draft int4; greedy, "
          f"at most {args.n} tokens, median of {args.runs} runs after a warm-up, configurations interleaved",
          file=sys.stderr)
    grammar = Grammar.json_schema(SCHEMA)

    def once(cname, prompt, n=args.n):
        engine, engine_spec = configs[cname]
        events = list(engine.generate(prompt, SamplingParams(max_tokens=n), engine_spec,
                                      constraint=engine.constraint(grammar)))
        return [e.token for e in events if e.token is not None], events[-1]

    results, answers, figures = [], {}, Figures()  # figures by (prompt, config, figure) over the runs
    for pname, prompt in prompts.items():
        for cname in configs:
            once(cname, prompt, 16)  # warm-up (kernels, policy timings)
        last_run = {}
        for r in range(args.runs):  # interleaved, so that drift on a shared machine hits every config alike
            for cname in rotated(list(configs), r):
                last_run[cname] = once(cname, prompt)  # (tokens, the final event)
                final = last_run[cname][1]
                figures.add((pname, cname, "tok/s"), final.timings.decode_tok_s)
                figures.add((pname, cname, "acceptance"), final.stats.acceptance_rate)
                figures.add((pname, cname, "tokens per round"), final.stats.mean_accepted_length)
        for cname in configs:
            speed = figures.median((pname, cname, "tok/s"))
            tokens, last = last_run[cname]
            text = tok.decode(tokens)
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid = True
            except (json.JSONDecodeError, jsonschema.ValidationError):
                valid = False
            answers.setdefault(pname, tokens)
            s = last.stats
            results.append({
                "prompt": pname, "config": cname, "decode_tok_s": speed, "runs": figures.samples[pname, cname, "tok/s"],
                "tokens": len(tokens), "finish_reason": last.finish_reason, "valid_json": valid,
                "same_as_plain": tokens == answers[pname],
                "acceptance": figures.median((pname, cname, "acceptance")),
                "tokens_per_round": figures.median((pname, cname, "tokens per round")),
                "mask_share": s.mask_share, "mask_ms": 1000 * s.mask_s, "text": text,
            })
            print(f"  {pname:9} {cname:24} {speed:6.2f} tok/s  {text[:60]!r}", file=sys.stderr)
    validity = sample_validity(configs["masked draft, adaptive"][0], prompts, grammar, args)
    libs = library_comparison(tok, target.config.vocab_size, list(answers.values()))
    print(f"\n{'library':22} {'setup s':>8} {'compile ms':>10} {'mask us (median)':>16} {'p99':>8}")
    for r in libs:
        if "setup_s" in r:
            print(f"{r['library']:22} {r['setup_s']:8.2f} {r['compile_ms']:10.1f} {r['mask_us_median']:16.1f} "
                  f"{r['mask_us_p99']:8.1f}")
        else:
            print(r["library"])
    print(f"\n{'prompt':9} {'config':24} {'tok/s':>6} {'x none':>6} {'accept':>6} {'tok/round':>9} {'mask %':>6} "
          f"{'tokens':>6} valid same")
    over_prompts = Figures()  # by (config, figure): each prompt's median
    for r in results:
        x_none = figures.ratio((r["prompt"], r["config"], "tok/s"), (r["prompt"], "no speculation", "tok/s"))
        print(f"{r['prompt']:9} {r['config']:24} {r['decode_tok_s']:6.2f} {x_none:6.2f} "
              f"{100 * r['acceptance']:5.0f}% {r['tokens_per_round']:9.2f} {100 * r['mask_share']:5.1f}% "
              f"{r['tokens']:6} {'yes' if r['valid_json'] else 'NO':5} {'yes' if r['same_as_plain'] else 'NO'}")
        for key, value in (("tok/s", r["decode_tok_s"]), ("x none", x_none), ("acceptance", r["acceptance"])):
            over_prompts.add((r["config"], key), value)
    print("\nmedians over prompts:")
    for cname in configs:
        print(f"  {cname:24} {over_prompts.median((cname, 'tok/s')):6.2f} tok/s "
              f"({over_prompts.median((cname, 'x none')):.2f}x no speculation), acceptance "
              f"{100 * over_prompts.median((cname, 'acceptance')):.0f}%")
    print(f"\n{validity['samples']} seeded samples at temperature 1 with speculation (constrained draft, adaptive): "
          f"{validity['complete']} complete, {validity['valid']} of them valid against the schema "
          f"(jsonschema), {validity['length']} ran out of tokens; acceptance {100 * validity['acceptance']:.0f}%")
    if args.json:
        args.json.write_text(json.dumps({"libraries": libs, "results": results, "validity": validity}, indent=1,
                                        ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
