"""quickdraft as a library: load a target with its draft, then generate from a prompt or from chat messages.

    import quickdraft

    llm = quickdraft.load("qwen2.5-coder-1.5b")  # draft="auto": its default draft speculates, n-gram lookup first
    out = llm.generate(messages=[{"role": "user", "content": "Reverse a list in Python"}], max_tokens=64)
    print(out.text)
    print(f"{out.stats.acceptance_rate:.0%} of drafts accepted, {out.timings.decode_tok_s:.1f} tok/s decode")

The command line, the server, tune, bench, verify, doctor and the scripts all go through `load` and `LLM`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from quickdraft import quant
from quickdraft.config import DEFAULT_MAX_CONTEXT, EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine, Event, Halt, Timings
from quickdraft.errors import QuickdraftError
from quickdraft.constraint import Constraint
from quickdraft.grammar import Grammar
from quickdraft.runtime.slots import KEPT_MAX  # noqa: F401 (api.KEPT_MAX: the CLI's help says it)
from quickdraft.speculative.draft import Draft, DraftBuilder
from quickdraft.speculative.policy import Prior
from quickdraft.speculative.stats import SpeculationStats
from quickdraft.weights import hub, machine, memory
from quickdraft.weights.loader import LoadedModel, load_model, resolve_device, resolve_dtype


@dataclass
class Completion:
    """One finished generation."""

    model: str
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # stop | length | cancelled
    timings: Timings
    stats: SpeculationStats  # what speculation (and a constraint) did
    constrained: bool = False

    def to_dict(self) -> dict:
        """What `quickdraft generate --json` prints."""
        speculated = self.stats.drafter != "none" or self.constrained
        return {"model": self.model, "text": self.text, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason, "timings": self.timings.to_dict(),
                "spec": self.stats.to_dict() if speculated else None}


class LLM:
    """A loaded target, the drafter its draft describes, and the engine that runs them (`load` makes one)."""

    def __init__(self, target: LoadedModel, engine: EngineConfig, draft: Draft = Draft(),
                 speculation: SpeculationConfig = SpeculationConfig(), progress: bool | None = None,
                 cache_slots: int = 4, cache_ram: int | None = None):
        self.target = target
        self.engine_config = engine
        self.drafts = DraftBuilder(target, engine, target.model.max_context, progress)
        self.draft = self.drafts.resolve(draft)  # `auto` made concrete
        self.engine = self.engine_for(self.draft, speculation, cache_slots, cache_ram)

    def cache_summary(self) -> str:
        """What the kept sequences may hold, in words (serve's start line)."""
        slots, context = self.engine.slots, self.context
        if slots.budget is None:
            host = (f", and {slots.host.budget / 2**30:.1f} GiB of host memory for those they give up"
                    if slots.host is not None else "")
            return f"{slots.count} kept sequences of up to {context} tokens{host}"
        per = self.engine.cache.position_bytes() + getattr(self.engine.drafter, "position_bytes", lambda: 0)()
        positions = slots.budget // max(per, 1)
        whole = f"{min(slots.count, max(1, positions // context))} of the whole context ({context})"
        if context <= 4096:  # (conversations of 4096 tokens would not fit the context)
            return f"{slots.budget / 2**30:.1f} GiB for kept sequences: {positions} tokens in all, e.g. {whole}"
        return (f"{slots.budget / 2**30:.1f} GiB for kept sequences: {positions} tokens in all, e.g. "
                f"{min(slots.count, max(1, positions // 4096))} conversations of 4096 tokens or {whole}")

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def context(self) -> int:
        return self.engine.context

    # ---- drafters and engines (bench, tune and doctor build several over one target) ------------------------

    def draft_models(self, draft: Draft | str) -> list[LoadedModel]:
        """The models a draft runs, loaded (once per LLM)."""
        return self.drafts.models(draft)

    def drafter(self, draft: Draft | str, speculation: SpeculationConfig | None = None):
        """The drafter a draft describes (None for none), its draft models loaded once per LLM."""
        return self.drafts.drafter(draft, speculation or self.engine.speculation)

    def engine_for(self, draft: Draft | str, speculation: SpeculationConfig = SpeculationConfig(), slots: int = 1,
                   cache_ram: int | None = None) -> Engine:
        """An engine over this target (its own KV caches and policy; one slot unless told: Engine) drafting with
        `draft`, its policy starting from this machine's prices (prior)."""
        drafter = self.drafter(draft, speculation)
        return Engine(self.target, self.target.model.max_context, drafter, speculation, slots,
                      prior(self.target, drafter), cache_ram)

    # ---- prompts ------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Chat messages rendered by the model's own chat template, ready for the assistant's answer, encoded."""
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

    def prompt_ids(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise QuickdraftError("give either a prompt or chat messages")
        if messages is not None:
            return self.chat_prompt(messages)
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    # ---- generation ---------------------------------------------------------------------------------------

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               params: SamplingParams | None = None, grammar: Grammar | Constraint | None = None,
               speculation: SpeculationConfig | None = None, halt: Halt | None = None,
               **sampling) -> Iterator[Event]:
        """Generate from a prompt (text or token ids) or chat messages: an Event per token (its text), then a
        final Event with the finish reason, timings and stats. Sampling settings as SamplingParams' fields
        (temperature=0 is greedy), or params; grammar constrains the output (a Grammar, or a Constraint already
        compiled by engine.constraint); speculation overrides the engine's settings for this generation."""
        ids = self.prompt_ids(prompt, messages)
        params = params or SamplingParams(**sampling)
        constraint = self.engine.constraint(grammar) if isinstance(grammar, Grammar) else grammar
        yield from self.engine.generate(ids, params, speculation, halt, constraint)

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 params: SamplingParams | None = None, grammar: Grammar | Constraint | None = None,
                 speculation: SpeculationConfig | None = None, **sampling) -> Completion:
        """stream, collected: the whole text, tokens, timings and stats."""
        ids = self.prompt_ids(prompt, messages)
        tokens, pieces = [], []
        for event in self.stream(ids, params=params, grammar=grammar, speculation=speculation, **sampling):
            pieces.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
            else:
                final = event
        return Completion(self.target.name, "".join(pieces), tokens, len(ids), final.finish_reason, final.timings,
                          final.stats, grammar is not None)


def prior(target: LoadedModel, drafter) -> Prior | None:
    """What the target's passes and each draft model's cost on this machine before any is timed (policy.Prior): its
    kernels' measured seconds per weight (weights/machine.py) times each model's weights; lookup drafts cost nothing.
    None where quickdraft's CPU kernels do not run the target (a GPU, float32): the policy then times everything."""
    if target.device.type != "cpu":
        return None
    found = machine.figures(hub.cache_dir())
    weights = machine.weight_seconds(target.model, found) if found is not None else None
    if weights is None:
        return None
    drafts, free = {}, set()
    for member in getattr(drafter, "members", [drafter] if drafter is not None else []):
        models = member.models
        if not models and member.lookup:
            free.update(member.sources)
        elif len(models) == 1 and len(member.sources) == 1 and models[0].device.type == "cpu":
            seconds = machine.weight_seconds(models[0].model, found)
            if seconds is not None:
                drafts[member.sources[0]] = (seconds, models[0].config.n_layers)
    return Prior(weights, target.config.n_layers, drafts, frozenset(free))


def load(model: str = hub.DEFAULT_TARGET, draft: Draft | str | None = "auto", *, device: str = "auto",
         dtype: str = "auto", weights: str = "auto", context: int | None = None,
         speculation: SpeculationConfig | None = None, draft_device: str | None = None, draft_weights: str = "auto",
         cuda_graphs: bool = True, weight_cache: bool = True, progress: bool | None = None, cache_slots: int = 4,
         cache_ram: int | str | None = None, warn=None, threads: int | None = None) -> LLM:
    """Load a target and its draft.

    model: an alias (pulled on first use), a .gguf file or a Hugging Face directory. draft: a Draft or its spelling
    (speculative/draft.py: "auto", "none" (or None), "ngram", a model, "ngram+MODEL"); draft_device and draft_weights
    place a draft model given by spelling. device, dtype, weights, context: as EngineConfig's. speculation: how much to
    draft (SpeculationConfig: draft_max, adaptive k, ...). cache_slots: sequences kept for prefix reuse (a prompt that
    begins with what one holds prefills only the rest: a chat's history), each a KV cache of `context` positions for the
    target and its draft, made when first needed; cache_ram: at most this many bytes ("2G" will do) for them on the CPU
    (as many conversations kept as fit, up to KEPT_MAX), and on a GPU for the conversations its slots give up, copied to
    host memory and back when they return. warn(QuickdraftError): what becomes of a warning about the load (the memory
    plan's; default: printed to stderr). threads: the CPU threads (default: what this machine's kernels run fastest
    with: weights/machine.py); weights "auto" on such a CPU is the format they decode this model fastest in."""
    engine = EngineConfig(device=device, dtype=dtype, weights=weights, max_context=context or None,
                          cuda_graphs=cuda_graphs, weight_cache=weight_cache, threads=threads)
    engine = for_this_machine(model, engine, progress)
    if isinstance(draft, str) or draft is None:  # None is Python's "no draft": the same as "none"
        draft = Draft.parse("none" if draft is None else draft, device=draft_device, weights=draft_weights)
    if cache_slots < 1:
        raise QuickdraftError("{cache_slots} must be at least 1 (the sequence being generated)", "cache_slots")
    warn = warn or (lambda problem: print(f"warning: {problem}", file=sys.stderr))
    window = speculation.draft_window if speculation is not None else None  # (the memory plan's draft cache)
    if not context:  # (0 as None, as llama.cpp's -c 0) the model's own, where its caches fit beside the weights, else
        #              the largest that does
        engine = replace(engine, max_context=fit_context(model, draft, engine, cache_slots, warn, window))
    if resolve_device(device).type == "cuda":  # what fits is known before any weight is read
        plan, cache_slots = fitting_slots(model, draft, engine, cache_slots, warn, window)
        memory.check(plan, warn=warn)
        if (sys.stderr.isatty() if progress is None else progress) and plan.warning() is None:
            print(f"memory plan: {plan.used / 2**30:.1f} GiB of {plan.device}'s {plan.capacity / 2**30:.1f} GiB "
                  f"({100 * plan.share:.0f}%; `quickdraft doctor` itemises it)", file=sys.stderr)
    ram = memory.parse_size(cache_ram) if isinstance(cache_ram, str) else cache_ram
    target = load_model(model, engine, progress)
    return LLM(target, engine, draft, speculation or SpeculationConfig(), progress, cache_slots, ram)


def for_this_machine(target: str, engine: EngineConfig, progress: bool | None = None) -> EngineConfig:
    """The engine config with what this machine's measured kernels choose (weights/machine.py) where it leaves them to
    us: the threads, and a 4-bit GGUF target's format under "auto" (mixed or int4). Measured once per machine, saying
    so on one line; nothing changes where quickdraft's CPU kernels do not run."""
    device = resolve_device(engine.device)
    if device.type != "cpu" or (engine.threads is not None and engine.weights != "auto"):
        if engine.threads:
            torch.set_num_threads(engine.threads)
        return engine
    say = machine.say_on_stderr if (sys.stderr.isatty() if progress is None else progress) else None
    found = machine.figures(hub.cache_dir(), say)
    if found is None:
        return engine
    torch.set_num_threads(engine.threads or found["threads"])
    if engine.weights != "auto" or quant.resolve("auto", device, resolve_dtype(engine.dtype, device)) != "mixed":
        return engine
    spec = memory.spec_from_source("target", target, "mixed")
    counts = {fmt: memory.linear_weights(spec.cfg, fmt, device, spec.types) for fmt in ("mixed", "int4")}
    if "int4" not in counts["mixed"]:  # a float checkpoint, or a file without 4-bit blocks: int8 keeps its quality
        return engine
    fmt, _ = machine.target_format(counts, found)
    return replace(engine, weights=fmt)


def fit_context(target: str, draft: Draft, engine: EngineConfig, slots: int, warn=None,
                window: int | None = None) -> int:
    """The context a load gives by default: the model's own where the memory plan fits it with `slots` kept
    sequences within memory.TIGHT of the device, else the largest power of two that does (at least
    DEFAULT_MAX_CONTEXT), saying so (warn)."""
    native = memory.spec_from_source("target", target, "bf16").cfg.max_context
    n = native
    while True:
        plan = memory_plan(target, draft, replace(engine, max_context=n), slots=slots, window=window)
        if plan.share <= memory.TIGHT or n <= DEFAULT_MAX_CONTEXT:
            break
        n = max(DEFAULT_MAX_CONTEXT, 1 << ((n - 1).bit_length() - 1))
    if n < native and warn is not None:
        warn(QuickdraftError(f"the model's context of {native} tokens with {slots} kept sequences would take "
                             f"{100 * plan.share:.0f}% of {plan.device}'s memory: using {n} tokens ({{context}} sets "
                             "it, {cache_slots} lowers what it takes)", "context", "cache_slots"))
    return n


def memory_plan(target: str, draft: Draft, engine: EngineConfig, capacity: int | None = None, free: int | None = None,
                slots: int = 1, window: int | None = None) -> memory.MemoryPlan:
    """What loading target (a source) with draft (a Draft, `auto` resolved here) under engine will take, worked out
    before any weight is read (weights/memory.py): the target in the format the loader will give it, what the draft's
    kind holds (speculative/base.Drafter.planned), caches for the context the load gives, for `slots` kept
    sequences (the engine's cache slots: runtime/slots.py); window: the draft window asked for (--draft-window).
    capacity and free: a stated size, else the device's."""
    # a stated size may plan for a device this machine lacks (--device cuda on a CPU machine)
    device = torch.device(engine.device) if capacity is not None and engine.device != "auto" else \
        resolve_device(engine.device)
    dtype = resolve_dtype(engine.dtype, device, engine.weights)
    spec = memory.spec_from_source("target", target, quant.resolve(engine.weights, device, dtype))
    context = engine.max_context or min(spec.cfg.max_context, DEFAULT_MAX_CONTEXT)
    draft = draft.resolve(target)
    kind = draft.drafter_class
    own = kind.planned(draft, spec.cfg, device, dtype, context, window) if kind is not None else []
    out = memory.plan([spec], context, device, capacity, free, own)
    if slots > 1:  # each kept sequence has caches of its own
        out.items = [memory.Item(i.what, i.nbytes * slots, f"{i.detail}, x {slots} kept sequences")
                     if "KV cache" in i.what else i for i in out.items]
    return out


def fitting_slots(target: str, draft: Draft, engine: EngineConfig, slots: int, warn=None,
                  window: int | None = None) -> tuple[memory.MemoryPlan, int]:
    """The plan with as many of `slots` kept sequences as fit (at least one: the plan then says if even that does
    not), and that number; warn(QuickdraftError) when fewer than asked."""
    for n in range(slots, 0, -1):
        out = memory_plan(target, draft, engine, slots=n, window=window)
        if out.fits or n == 1:
            if n < slots and warn is not None:
                warn(QuickdraftError(f"{slots} kept sequences do not fit on {out.device}: keeping {n} "
                                     "({cache_slots})", "cache_slots"))
            return out, n
    raise AssertionError("unreachable")
