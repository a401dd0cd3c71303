"""The commands: each parses what its flags mean, calls the library (api.py and the command's own module), and
formats what comes back."""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
from pathlib import Path

from quickdraft.errors import QuickdraftError
from quickdraft.tools.flags import say

DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short docstring."


def speculation_config(args):
    from quickdraft.config import SpeculationConfig

    return SpeculationConfig(draft_max=args.draft_max, draft_min=args.draft_min, p_min=args.draft_p_min,
                             adaptive=not args.fixed_k, constrain_draft=not getattr(args, "blind_draft", False),
                             draft_vocab=getattr(args, "draft_vocab", 0), tree=getattr(args, "draft_tree", None) or 1,
                             draft_window=getattr(args, "draft_window", None),
                             draft_history=getattr(args, "draft_history", 16384))


def grammar_of(args):
    """The constraint the generate flags ask for, or None."""
    from quickdraft.grammar import Grammar

    if args.json_schema:
        return Grammar("json_schema", _read_text(args.json_schema))
    if args.json_object:
        return Grammar("json_object")
    if args.regex is not None:
        return Grammar("regex", args.regex)
    if args.grammar:
        return Grammar("grammar", _read_text(args.grammar))
    return None


def draft_of(args):
    """The Draft the --draft flags (or a --profile) describe, `auto` made concrete for -m."""
    from quickdraft.speculative.draft import Draft

    return Draft.parse(args.draft, getattr(args, "ngram", False), getattr(args, "draft_device", None),
                       getattr(args, "draft_weights", "auto")).resolve(args.model)


def load(args, draft=None):
    """The LLM the flags ask for: -m and its engine options, with `draft` (a Draft; default: the --draft flags')."""
    from quickdraft import api

    speculation = speculation_config(args) if hasattr(args, "draft_max") else None
    return api.load(args.model, draft if draft is not None else draft_of(args), device=args.device,
                    dtype=getattr(args, "dtype", "auto"), weights=getattr(args, "weights", "auto"),
                    context=getattr(args, "ctx", None) or None, speculation=speculation,
                    cuda_graphs=getattr(args, "cuda_graphs", True), weight_cache=getattr(args, "weight_cache", True),
                    cache_slots=getattr(args, "cache_slots", 1), cache_ram=getattr(args, "cache_ram", None),
                    warn=lambda problem: print(f"warning: {say(problem)}", file=sys.stderr),
                    threads=getattr(args, "threads", None))


def engine_config(args):
    """The EngineConfig the flags describe (as `load` passes them on)."""
    from quickdraft.config import EngineConfig

    return EngineConfig(device=args.device, dtype=getattr(args, "dtype", "auto"),
                        weights=getattr(args, "weights", "auto"), max_context=getattr(args, "ctx", None) or None,
                        cuda_graphs=getattr(args, "cuda_graphs", True), weight_cache=getattr(args, "weight_cache", True))


def apply_profile(args) -> None:
    """--profile FILE: the draft and k that `quickdraft tune` chose, and the target's weight format it measured
    them in (which --weights overrides; a format other than the file's quality is there only when the user let
    `tune --formats` choose one)."""
    if not getattr(args, "profile", None):
        return
    from quickdraft.tools.tune import read_profile

    profile = read_profile(args.profile)
    if profile["target"] != args.model:
        print(f"warning: {args.profile} was tuned for {profile['target']}, not {args.model}", file=sys.stderr)
    if getattr(args, "weights", None) == "auto" and profile.get("weights"):
        args.weights = profile["weights"]
    args.draft, args.ngram = profile["draft"], False
    if profile["draft"] != "none":
        args.draft_max, args.fixed_k = int(profile["draft_max"]), bool(profile.get("fixed_k", True))
        args.draft_p_min = float(profile.get("p_min", args.draft_p_min))
        if getattr(args, "draft_vocab", 0) == 0:
            args.draft_vocab = int(profile.get("draft_vocab", 0))
        if getattr(args, "draft_tree", None) is None:  # --draft-tree given wins over the profile's
            args.draft_tree = int(profile.get("draft_tree", 1))
        args.draft_min = min(args.draft_min, args.draft_max)


def cmd_generate(args) -> int:
    from quickdraft.config import SamplingParams

    params = SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, repetition_window=args.repeat_last_n,
        seed=args.seed, max_tokens=args.max_tokens, stop_at_eos=not args.ignore_eos,
    )
    text = args.prompt if args.prompt is not None else _read_text(args.prompt_file)
    apply_profile(args)
    llm = load(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = llm.prompt_ids(messages=messages + [{"role": "user", "content": text}])
    else:
        prompt = llm.prompt_ids(text)
    constraint = llm.engine.constraint(grammar_of(args))  # a bad schema or grammar fails here, before generating
    _show(llm, llm.stream(prompt, params=params, grammar=constraint), len(prompt), args.json, constraint is not None)
    return 0


def _show(llm, events, prompt_n: int, as_json: bool, constrained: bool = False):
    """Stream one generation's text to stdout and its figures to stderr (or print it as JSON); its Completion."""
    from quickdraft.api import Completion

    tokens, pieces = [], []
    for event in events:
        if event.token is not None:
            tokens.append(event.token)
        else:
            final = event
        pieces.append(event.text)
        if not as_json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    done = Completion(llm.target.name, "".join(pieces), tokens, prompt_n, final.finish_reason, final.timings,
                      final.stats, constrained)
    if as_json:
        print(json.dumps(done.to_dict(), ensure_ascii=False))
        return done
    t = done.timings
    print(file=sys.stdout)
    print(f"[{done.finish_reason}] TTFT {t.ttft_s:.2f} s | prefill {t.prefill_tok_s:.1f} tok/s "
          f"({t.prompt_n} tokens) | decode {t.decode_tok_s:.1f} tok/s ({t.n_decoded} tokens)", file=sys.stderr)
    if done.stats.drafter != "none" or constrained:
        print(done.stats.summary(), file=sys.stderr)
    return done


def cmd_perplexity(args) -> int:
    from quickdraft.perplexity import perplexity
    from quickdraft.speculative.draft import NONE
    from quickdraft.ui import progress_bar

    lm = load(args, NONE).target
    tokens = lm.tokenizer.encode(_read_text(args.file))  # with BOS where the model adds one, as llama-perplexity
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    windows = min(len(tokens) // args.ctx, args.chunks or len(tokens))
    with progress_bar("scoring", max(windows, 1)) as update:
        result = perplexity(lm.model, tokens, args.ctx, bos, args.chunks, update)
    if args.json:
        print(json.dumps({"ppl": result.ppl, "tokens": result.tokens, "chunks": result.chunks, "ctx": args.ctx}))
    else:
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens ({result.chunks} windows of {args.ctx})")
    return 0


def cmd_tokenize(args) -> int:
    from quickdraft.weights.loader import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    text = args.text if args.text is not None else _read_text(args.file)
    ids = tokenizer.encode(text, add_bos=False if args.no_bos else None)
    pieces = []  # what each token adds to the text (with a few before it: a piece's space shows)
    for n, i in enumerate(ids):
        before, after = tokenizer.decode(ids[max(0, n - 8):n]), tokenizer.decode(ids[max(0, n - 8):n + 1])
        pieces.append(after[len(before):] if after.startswith(before) else tokenizer.decode([i]))
    if args.json:
        print(json.dumps({"ids": ids, "pieces": pieces, "tokens": [tokenizer.token_text(i) for i in ids]},
                         ensure_ascii=False))
    elif args.ids:
        print(ids)
    else:
        for i, piece in zip(ids, pieces):
            print(f"{i:8} -> {piece!r}")
        print(f"{len(ids)} tokens", file=sys.stderr)
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


def _prompts(args, tokenizer) -> dict[str, list[int]]:
    from quickdraft.tools.prompts import encoded

    return encoded(tokenizer, _prompt_names(args))


def _prompt_names(args) -> list[str]:
    from quickdraft.tools.prompts import NAMES, PROMPTS

    names = args.prompts.split(",") if args.prompts else list(PROMPTS)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise QuickdraftError(f"unknown prompt {unknown[0]!r}: choose from {', '.join(NAMES)}")
    return names


def _prompt_texts(args) -> dict[str, str]:
    """The bundled prompts as text: a server applies its own chat template."""
    from quickdraft.tools.prompts import text

    return {name: text(name) for name in _prompt_names(args)}


def _counter(update):
    """progress(n) for the library, from a progress bar's update(completed)."""
    done = [0]

    def step(n):
        done[0] += n
        update(done[0])

    return step


def cmd_verify(args) -> int:
    from quickdraft.tools import prompts as bundled
    from quickdraft.ui import progress_bar
    from quickdraft.tools.verify import verify

    if args.url or args.reference_url:
        return _verify_remote(args)
    apply_profile(args)
    if draft_of(args).kind == "none":
        raise QuickdraftError("verify needs a draft: give --draft MODEL, --draft ngram, or --draft ngram+MODEL")
    llm = load(args)
    engine, tokenizer = llm.engine, llm.tokenizer
    prompts = _prompts(args, tokenizer)
    with progress_bar("verifying", 2 * len(prompts) + 2 + args.draws, unit="items") as update:
        report = verify(engine, prompts, args.max_tokens, args.temp, args.top_k, args.draws,
                        bundled.encoded(tokenizer, ["qa-en"])["qa-en"], progress=_counter(update))
    if args.json:
        print(json.dumps({"target": llm.target.name, "draft": engine.drafter_name, **report.to_dict()}))
    else:
        print(f"verify: target {llm.target.name}, draft {engine.drafter_name}")
        print(report.text(tokenizer))
    return 0 if report.passed else 1


def _verify_remote(args) -> int:
    from quickdraft.tools import remote

    if not (args.url and args.reference_url):
        raise QuickdraftError("verify against servers needs both --url (the speculative one) and --reference-url "
                              "(the same model without speculation)")
    if args.profile is not None:
        raise QuickdraftError("--profile sets a local draft: with --url each server runs its own settings; drop it")
    spec = remote.Endpoint(args.url, args.api_key, args.served_model)
    reference = remote.Endpoint(args.reference_url, args.api_key, args.served_model)
    result = remote.verify(spec, reference, _prompt_texts(args), args.max_tokens)
    print(json.dumps(result) if args.json else remote.verify_report(result))
    return 0 if result["identical"] else 1


def cmd_tune(args) -> int:
    from quickdraft.tools import tune
    from quickdraft.speculative.draft import NONE, Draft
    from quickdraft.weights import hub

    if args.from_profile is not None:
        if args.export is None:
            raise QuickdraftError("--from exports a profile: give --export llama-server, vllm or sglang")
        print(_export(args, tune.read_profile(args.from_profile)))
        return 0
    if not 1 <= args.draft_tree <= 8:
        raise QuickdraftError("--draft-tree must be 1 (chains alone) to 8 candidates at a position")
    llm = load(args, NONE)
    builtin = llm.target.model.mtp is not None  # the target drafts for itself: its MTP layers are the candidates
    candidates = args.drafts or (["mtp", "ngram", "ngram+mtp"] if builtin else
                                 [hub.DEFAULT_DRAFT, "ngram", "suffix", f"ngram+{hub.DEFAULT_DRAFT}",
                                  f"suffix,{hub.DEFAULT_DRAFT}"])
    drafts = [Draft.parse(c, weights=args.draft_weights) for c in candidates]
    if args.formats is None:
        if args.quality_bound is not None:
            raise QuickdraftError("--quality-bound bounds the formats --formats lets tune choose from: give --formats")
        profile = tune.run(llm, drafts, _prompts(args, llm.tokenizer), args.kmax, args.draft_p_min, args.max_tokens,
                           vocab=args.draft_vocab, tree=args.draft_tree)
    else:
        formats = _formats(args.formats)
        prompts = _prompts(args, llm.tokenizer)
        llm = None  # loaded again in each format

        def load_in(fmt: str):
            return load(argparse.Namespace(**{**vars(args), "weights": fmt}), NONE)

        bound = tune.QUALITY_BOUND if args.quality_bound is None else args.quality_bound
        profile = tune.by_format(load_in, formats, lambda llm: drafts, prompts, args.kmax, args.draft_p_min,
                                 args.max_tokens, bound, vocab=args.draft_vocab, tree=args.draft_tree)
    tune.write_profile(args.profile, profile)
    if args.json:
        print(json.dumps(profile))
        return 0
    print(tune.report(profile))
    print(f"profile: {args.profile} (use it with: quickdraft generate --profile {args.profile} ...)")
    if args.export:
        print(_export(args, profile))
    return 0


def _formats(spec: str) -> list[str]:
    from quickdraft.quant import FORMATS

    formats = [f.strip() for f in spec.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise QuickdraftError(f"--formats {spec!r}: give formats from {', '.join(FORMATS)}, comma-separated "
                              "(e.g. mixed,int4)")
    return list(dict.fromkeys(formats))


def _export(args, profile: dict) -> str:
    """The profile as another engine's flags; llama-server gets the GGUF files of the default models' aliases."""
    from quickdraft.tools.export import export
    from quickdraft.weights import hub

    def gguf(name: str | None) -> str | None:
        return str(hub.model_path(name)) if name in hub.DEFAULT_MODELS else name

    members = profile["draft"].replace("ngram+", "ngram,", 1).split(",") if profile["draft"] != "none" else []
    draft = next((m for m in members if m != "ngram"), None)  # a chain's drafter other than lookup
    if draft == "mtp":
        raise QuickdraftError("the profile drafts with the target's MTP layers, which --export does not write yet: "
                              "export a profile of a draft model or ngram")
    return export(profile, args.export, gguf(profile["target"]), gguf(draft))


def cmd_bench(args) -> int:
    from quickdraft.tools import bench
    from quickdraft.speculative.draft import NONE
    from quickdraft.ui import progress_bar

    if args.conversation:
        return _bench_conversation(args)
    args.max_tokens = args.max_tokens or 128
    if args.url:
        return _bench_remote(args)
    apply_profile(args)
    draft = draft_of(args)
    configs = bench.parse_configs(args.configs or bench.default_configs(draft), draft)
    llm = load(args, NONE)
    prompts = _prompts(args, llm.tokenizer)
    if args.concurrency > 1:  # streams at once (engine.Batch), beside the same one by one
        with progress_bar("benchmarking", len(configs) * args.runs, unit="items") as update:
            result = bench.concurrent(llm, configs, prompts, args.max_tokens, args.concurrency, args.runs,
                                      speculation_config(args), _counter(update))
        result.update(target=llm.target.name, draft=str(draft))
        print(bench.concurrent_table(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    with progress_bar("benchmarking", len(prompts) * len(configs) * args.runs, unit="items") as update:
        result = bench.run(llm, configs, prompts, args.max_tokens, args.runs, args.warmup, speculation_config(args),
                           _counter(update))
    result.update(target=llm.target.name, draft=str(draft))
    print(bench.table(result))
    if args.roofline:
        from quickdraft.tools import roofline

        models = llm.draft_models(draft) if any(not getattr(c.draft.drafter_class, "lookup", False) for c in configs) else []
        result["roofline"] = roofline.report(llm.target, models, result["rows"], next(iter(prompts.values())))
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
    import torch

    from quickdraft.tools import doctor
    from quickdraft.tools.doctor import Finding
    from quickdraft.api import memory_plan
    from quickdraft.speculative.draft import NONE

    apply_profile(args)
    if args.measure:  # before the load, whose defaults they choose
        from quickdraft.weights import hub, machine

        machine.figures(hub.cache_dir(), machine.say_on_stderr, again=True)
    draft = draft_of(args)
    available = int(args.device_memory * 2**30) if args.device_memory else None
    args.cache_slots = max(args.cache_slots, args.parallel)  # as serve: each running request holds a slot
    plan = memory_plan(args.model, draft, engine_config(args), available, slots=args.cache_slots,
                       window=getattr(args, "draft_window", None))
    planned = doctor.memory_plan(plan)
    cuda_absent = plan.device_type == "cuda" and not torch.cuda.is_available()
    if planned.level == "error" or cuda_absent:  # nothing to load: the plan says it all
        note = (Finding("load", "warn", "not loaded: the plan does not fit") if planned.level == "error" else
                Finding("load", "ok", "no CUDA device here: the plan only"))
        findings = [planned, note]
    else:
        llm = load(args, NONE)
        findings, _ = doctor.run(llm, draft, available, planned=planned)
    errors = sum(f.level == "error" for f in findings)
    if args.json:
        print(json.dumps({"target": args.model, "draft": str(draft), "ok": errors == 0,
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
    from quickdraft import api
    from quickdraft.config import SamplingParams, SpeculationConfig
    from quickdraft.weights import hub

    cmd_pull(argparse.Namespace(list=False, print_path=None, aliases=[]))
    llm = api.load(hub.DEFAULT_TARGET, hub.DEFAULT_DRAFT, device=args.device, context=2048)
    prompt = llm.chat_prompt([{"role": "user", "content": DEMO_PROMPT}])
    params = SamplingParams(max_tokens=args.max_tokens)
    outputs = []
    for label, speculation in (("plain decoding", SpeculationConfig(draft_max=0)),
                               (f"speculative, draft {hub.DEFAULT_DRAFT}", None)):
        print(f"\n== {hub.DEFAULT_TARGET}, {label} ==", file=sys.stderr)
        events = llm.stream(prompt, params=params, speculation=speculation)
        outputs.append(_show(llm, events, len(prompt), as_json=False).tokens)
    same = outputs[0] == outputs[1]
    print(f"\nspeculative output identical to plain output: {'yes' if same else 'NO'}", file=sys.stderr)
    return 0 if same else 1


CACHE_RAM = 8 * 2**30  # llama-server's --cache-ram default


def default_cache_ram(device: str) -> str:
    """serve's --cache-ram where none is given: llama-server's default, at most a quarter of the memory this process
    may use (a container's limit where it has one). On the CPU (whose caches take memory as they fill) so that more
    conversations are kept than run at once (up to api.KEPT_MAX); on a GPU (whose slots are whole caches the memory
    plan counts: --cache-slots) for the conversations the slots give up, kept in host memory."""
    from quickdraft.weights.memory import host_memory

    return f"{min(CACHE_RAM, host_memory() // 4) // 2**20}M"


def cmd_serve(args) -> int:
    from quickdraft.config import SamplingParams, SpeculationConfig
    from quickdraft.server.app import LOOPBACK_NAMES, ServerState, create_app
    from quickdraft.runtime.plan import cpu_path_line
    from quickdraft.server.connections import serve
    from quickdraft.server.metrics import Metrics
    from quickdraft.server.worker import EngineWorker
    from quickdraft.weights import hub

    if args.max_queue < 1:
        raise QuickdraftError("--max-queue must be at least 1")
    if args.parallel < 1:
        raise QuickdraftError("--parallel must be at least 1")
    args.cache_slots = max(args.cache_slots, args.parallel)  # each running request holds a slot
    if args.cache_ram is None:
        args.cache_ram = default_cache_ram(args.device)
    if not args.request_timeout > 0:
        raise QuickdraftError("--request-timeout must be a positive number of seconds")
    api_key = _api_key(args)
    apply_profile(args)
    sock = _listen(args.host, args.port)

    def serving_llm():
        llm = load(args)
        for _ in llm.stream("Hello", params=SamplingParams(max_tokens=4), speculation=SpeculationConfig(draft_max=0)):
            pass  # warm-up: one-off kernel setup is paid here, not by the first request
        try:  # what the first message holding special-token text would wait for
            llm.target.tokenizer.prepare()
        except Exception as e:  # noqa: BLE001 (that request meets it then, as before; serving goes on)
            print(f"warning: the tokenizer's literal copy: {e}", file=sys.stderr)
        try:  # llguidance's view of the vocabulary, built before the first request
            llm.engine.grammars.ll_tokenizer
        except QuickdraftError as e:  # plain requests are unaffected; constrained ones get this message as a 400
            print(f"warning: {e}", file=sys.stderr)
        return llm

    # Loaded on the thread that will run it (see server/worker.py): running it on another costs a quarter
    worker = EngineWorker(serving_llm, args.max_queue, Metrics(), args.parallel)
    engine, target = worker.engine, worker.llm.target
    model_id = args.model if args.model in hub.DEFAULT_MODELS else target.name
    host, port = sock.getsockname()[:2]
    loopback = ipaddress.ip_address(host).is_loopback
    allowed = LOOPBACK_NAMES | {h.lower() for h in args.allowed_host} if loopback else None
    cors = tuple(o.strip().rstrip("/") for o in args.cors_origins.split(",") if o.strip()) if args.cors_origins else None
    state = ServerState(worker, model_id, frozenset({args.model, target.name, *args.alias}), api_key, allowed,
                        strict_model_name=args.strict_model_name, cors_origins=cors,
                        special_tokens_in_messages=args.special_tokens_in_messages, api_docs=args.api_docs)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    parallel = min(args.parallel, engine.slots.count)  # the memory plan may have kept fewer slots
    if parallel < args.parallel:
        print(f"warning: {engine.slots.count} cache slots fit: {parallel} requests generate at once, not "
              f"{args.parallel} (--parallel); lower --ctx to fit more", file=sys.stderr)
    print(f"quickdraft: serving {model_id} (draft: {engine.drafter_name}, context {engine.context}, {parallel} "
          f"request{'s' if parallel > 1 else ''} in parallel) at {url}/v1", flush=True)
    print(f"chat page: {url}/", flush=True)
    print(f"cache: {worker.llm.cache_summary()}", flush=True)
    print(f"kernels: {cpu_path_line(target)}", flush=True)
    auth = ' -H "Authorization: Bearer $QUICKDRAFT_API_KEY"' if api_key else ""  # the key itself is never printed
    print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          """-d '{"messages": [{"role": "user", "content": "Write hello world in C"}], "max_tokens": 64}'""",
          flush=True)
    serve(create_app(state), sock, args.debug, args.request_timeout)
    return 0


def _api_key(args) -> str | None:
    if args.api_key_file is None:
        return args.api_key or None
    text = _read_text(args.api_key_file).strip()
    key = text.splitlines()[0].strip() if text else ""
    if not key:
        raise QuickdraftError(f"{args.api_key_file} holds no API key: write the key on its first line")
    return key


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


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuickdraftError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise QuickdraftError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


COMMANDS = {"generate": cmd_generate, "perplexity": cmd_perplexity, "pull": cmd_pull, "demo": cmd_demo,
            "tokenize": cmd_tokenize,
            "serve": cmd_serve, "verify": cmd_verify, "doctor": cmd_doctor, "bench": cmd_bench, "tune": cmd_tune}


def _bench_conversation(args) -> int:
    """bench --conversation: the loaded pair with prefix reuse and without (every turn prefilled whole), or each
    --url server, each conversation alone."""
    from quickdraft.tools import conversation, remote

    n = args.max_tokens or 48
    if args.url:
        replies = []
        for url in args.url:
            endpoint = remote.Endpoint(url, args.api_key, args.served_model)
            endpoint.check()
            replies.append((url, conversation.remote_reply(endpoint)))
    else:
        apply_profile(args)
        llm = load(argparse.Namespace(**{**vars(args), "cache_slots": 1}))
        name = f"quickdraft, {llm.engine.drafter_name}"
        replies = [(f"{name}, reuse", conversation.local_reply(llm)),
                   (f"{name}, no reuse", conversation.local_reply(llm, reuse=False))]
    runs = []
    for name, reply in replies:
        print(f"bench: conversation on {name}", file=sys.stderr)
        runs.append(conversation.converse(name, reply, args.conversation, args.turns, n))
    print(conversation.table(runs, args.conversation, n))
    if args.json:
        args.json.write_text(json.dumps(conversation.to_dict(runs, args.conversation, n), indent=1))
        print(f"results: {args.json}", file=sys.stderr)
    return 0


def _bench_remote(args) -> int:
    from quickdraft.tools import remote
    from quickdraft.ui import progress_bar

    local = [flag for flag, given in (("--configs", args.configs), ("--roofline", args.roofline),
                                      ("--plots", args.plots), ("--profile", args.profile)) if given]
    if local:  # the servers' own settings decide: refuse what would be ignored
        raise QuickdraftError(f"{', '.join(local)} measure local configurations: with --url each server runs its "
                              "own settings; drop them, or drop --url")
    metrics = args.metrics_url or []
    if len(metrics) > len(args.url):
        raise QuickdraftError("more --metrics-url than --url: give one per server, in the order of the --url flags")
    endpoints = [remote.Endpoint(url, args.api_key, args.served_model, metrics[i] if i < len(metrics) else None)
                 for i, url in enumerate(args.url)]
    prompts = _prompt_texts(args)
    with progress_bar("benchmarking", len(prompts) * len(endpoints) * args.runs, unit="items") as update:
        result = remote.bench(endpoints, prompts, args.max_tokens, args.runs, args.warmup, args.concurrency,
                              _counter(update))
    print(remote.bench_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"results: {args.json}", file=sys.stderr)
    return 0
