"""`quickdraft doctor`: checks what users otherwise find out the slow way, and says what to do.

Each check is a function returning a Finding (ok, warn or error) with a one-line message naming the fix
and the figures behind it, so that tests can create each fault and see it reported.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from quickdraft import quant
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.speculative.draft import NONE
from quickdraft.speculative.vocab import check_compatible
from quickdraft.tools.flags import say

WARN_SHARE = 0.9  # of the device's memory


@dataclass
class Finding:
    check: str
    level: str  # ok | warn | error
    message: str
    figures: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _bytes(module: torch.nn.Module) -> Counter:
    """Bytes of parameters and buffers per device."""
    per_device = Counter()
    for t in list(module.parameters()) + list(module.buffers()):
        per_device[str(t.device)] += t.numel() * t.element_size()
    return per_device


def _same(a: str, b: torch.device) -> bool:
    a = torch.device(a)
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def placement(model: torch.nn.Module, intended: torch.device, role: str) -> Finding:
    """Every weight of `model` on `intended`; otherwise which bytes are elsewhere."""
    per_device = _bytes(model)
    total = sum(per_device.values())
    off = {d: b for d, b in per_device.items() if not _same(d, intended)}
    figures = {"intended": str(intended), "bytes_by_device": dict(per_device)}
    if not off:
        return Finding(f"{role} placement", "ok", f"all {total / 2**20:.0f} MiB of the {role}'s weights are on "
                                                   f"{intended}", figures)
    where = ", ".join(f"{b / 2**20:.1f} MiB on {d}" for d, b in off.items())
    level = "warn" if intended.type == "cuda" and all(torch.device(d).type == "cpu" for d in off) else "error"
    return Finding(f"{role} placement", level,
                   f"{where} of the {role}'s weights are not on {intended}: every step would copy or wait for "
                   f"them; load with --device {intended} and enough free memory", figures)


def _graphs(lm) -> str:
    """Whether a model's passes replay CUDA graphs, or why not."""
    if lm.graphs is None:
        return "off (--no-cuda-graphs)"
    return f"off ({lm.graphs.disabled})" if lm.graphs.disabled else "on"


def kernels(*models) -> Finding:
    """On a CPU with bf16 activations: whether quickdraft's own kernels run the models' weights (and each decoder
    layer as one fused step), or why not."""
    from quickdraft.quant import vnni

    formats = ", ".join(f"{m.name.split('/')[-1]} {m.weights}" for m in models)
    figures = {"formats": formats, "plans": {m.name: m.plan for m in models}}
    on_cuda = [m for m in models if m.device.type == "cuda"]
    if on_cuda:
        from quickdraft.quant import gpu

        layers = sorted({k for m in on_cuda for k in m.plan.get("linear", {})})
        reason = gpu.triton_reason()
        slow = (f"; int8 runs on PyTorch's kernel, which reads the weights once per row ({reason}): install Triton"
                if reason and any(m.weights in ("int8", "mixed") for m in on_cuda) else "")
        passes = (f"; passes of {on_cuda[0].plan.get('rows')} rows, attention: {on_cuda[0].plan.get('attention')}; "
                  + ", ".join(f"{m.name.split('/')[-1]} graphs {_graphs(m)}" for m in on_cuda))
        return Finding("kernels", "warn" if slow else "ok", f"CUDA: {', '.join(layers)} ({formats}){passes}{slow}",
                       figures)
    if not any(m.device.type == "cpu" and m.model.dtype == torch.bfloat16 for m in models):
        from quickdraft.quant import avx2

        if any(m.device.type == "cpu" and m.model.dtype == torch.float32 for m in models) and avx2.available():
            return Finding("kernels", "ok", f"quickdraft's AVX2 float32 kernels: linear layers and activations "
                           f"({formats})", figures)
        return Finding("kernels", "ok", f"not on a bf16 CPU path ({formats})", figures)
    if vnni.available():
        steps = [(m, m.plan.get("fused_layers", 0), m.plan.get("layers", 0)) for m in models]
        fused = "; ".join(f"{m.name.split('/')[-1]}: {f} of {n} layers as one fused step" for m, f, n in steps)
        slow = [m.name.split("/")[-1] for m, f, n in steps if m.weights in quant.QUANTIZED and f < n]
        tail = (f" (the other layers of {', '.join(slow)} run module by module, on the same kernels: their shapes or "
                "parts are not the fused step's)") if slow else ""
        return Finding("kernels", "ok", f"quickdraft's {vnni.isa_name()} kernels ({formats}); {fused}{tail}",
                       {**figures, "isa": vnni.isa()})
    reason = vnni.unavailable_reason()
    fix = ("install a C++ compiler (g++) and ninja, then run again" if "build" in reason
           else "PyTorch's slower ops are used; nothing to install")
    return Finding("kernels", "warn", f"quickdraft's CPU kernels are off: {reason}; {fix} ({formats})",
                   {**figures, "reason": reason})


def exactness(target) -> Finding:
    """The target's kernel path and compute dtype, and whether its output is bit-exact there with speculation, prefix
    reuse and batching (runtime/plan.cpu_path): a warning where it is not."""
    from quickdraft.runtime import plan

    path, exact = plan.cpu_path(target)
    return Finding("exactness", "ok" if exact else "warn", plan.cpu_path_line(target),
                   {"path": path, "dtype": str(target.model.dtype).removeprefix("torch."), "bit_exact": exact})


def machine_defaults(target) -> Finding:
    """What this machine's measured kernels chose by default (weights/machine.py): the threads and a 4-bit GGUF
    target's format, with the figures they were chosen by."""
    from quickdraft.weights import hub, machine, memory

    if target.device.type != "cpu":
        return Finding("machine", "ok", f"{target.device}: the defaults are the device's (docs/gpu.md)")
    found = machine.figures(hub.cache_dir())
    if found is None:
        return Finding("machine", "ok", "quickdraft's CPU kernels do not run here: PyTorch's choices")
    per = {kind: {rows: 1e12 * s for rows, s in by.items()} for kind, by in found["seconds_per_weight"].items()}
    costs = "; ".join(f"{kind} {per[kind]['1']:.0f} ps a weight for a step's row, {per[kind]['5']:.0f} for a "
                      "verification's 5" for kind in per)
    spread = f", passes within {100 * found['spread']:.0f}% of their median" if "spread" in found else ""
    line = f"{found['threads']} threads; {costs} (measured {found['measured']}{spread}; doctor --measure again)"
    figures = {**found, "target_weights": target.weights}
    try:
        spec = memory.spec_from_source("target", target.name, "mixed")
        counts = {fmt: memory.linear_weights(spec.cfg, fmt, target.device, spec.types) for fmt in ("mixed", "int4")}
    except Exception:  # noqa: BLE001 -- a model not from a file (a stand-in): the figures alone
        counts = None
    if counts and "int4" in counts["mixed"]:
        fmt, why = machine.target_format(counts, found)
        line += f"; auto gives this target {fmt}: {why}"
        figures["auto_format"] = fmt
    return Finding("machine", "ok", line, figures)


def loading(*models) -> Finding:
    """How each model was loaded: converted now (and kept on disk for the next load), or its kept conversion read
    back; on CUDA, whether its passes replay CUDA graphs."""
    parts, figures = [], {"models": []}
    for m in models:
        name = m.name.split("/")[-1]
        if m.kept_from is not None:
            how = f"read back its kept {m.weights} conversion"
        elif m.weights in quant.QUANTIZED:
            how = f"converted to {m.weights}"
        else:
            how = f"loaded in {m.weights}"
        graphs = m.graphs
        if m.device.type == "cuda":
            how += ", CUDA graphs " + ("on" if graphs is not None and graphs.disabled is None else "off")
        parts.append(f"{name} {how} in {m.load_seconds:.1f} s")
        figures["models"].append({"model": name, "load_s": round(m.load_seconds, 2),
                                  "kept_from": str(m.kept_from) if m.kept_from else None})
    off = [m for m in models if m.graphs is not None and m.graphs.disabled and not m.model.hybrid
           and not m.model.cfg.n_experts]
    if off:
        return Finding("loading", "warn", "; ".join(parts) + f" (graphs off: {off[0].graphs.disabled}; decoding "
                       "runs eagerly, slower; please report it)", figures)
    return Finding("loading", "ok", "; ".join(parts), figures)


def draft_device(target: torch.device, draft: torch.device | None) -> Finding:
    if draft is None:
        return Finding("draft device", "ok", "no draft model (n-gram lookup runs on the host, the target's own MTP "
                                             "layers on its device)")
    figures = {"target": str(target), "draft": str(draft)}
    if target.type == "cuda" and draft.type != "cuda":
        return Finding("draft device", "warn", f"the draft runs on {draft} while the target runs on {target}: "
                       "a draft on a slower device costs more than it saves; drop --draft-device", figures)
    if target != draft:
        return Finding("draft device", "warn", f"the draft runs on {draft}, the target on {target}: each round "
                       "moves tokens between devices; put both on one (--draft-device)", figures)
    return Finding("draft device", "ok", f"draft and target both on {target}", figures)


def device_memory(device: torch.device) -> int:
    """Total memory of the device in bytes (for the CPU the memory this process may use: memory.host_memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    from quickdraft.weights.memory import host_memory

    return host_memory()


def kv_bytes(cache) -> int:
    return cache.nbytes()


def memory(target, drafts: list, engine, available: int) -> Finding:
    """Weights of the target and the draft models, the KV caches of the engine and its drafter for the context in
    each kept sequence (cache slot), and the activations of a round, against `available` bytes; warn above 90%,
    error above 100%."""
    from quickdraft.weights import memory as memory_plan

    weights = sum(sum(_bytes(m.model).values()) for m in [target, *drafts])
    slots = engine.slots.count
    kv = slots * (kv_bytes(engine.cache) + (engine.drafter.cache_bytes() if engine.drafter is not None else 0))
    cfg = target.config
    k = engine.speculation.draft_max + 1
    # the largest pass (a prefill runs in passes of a chunk's rows) over the whole context, and its float32 logits
    activations = memory_plan.activation_bytes(cfg, engine.context, max(k, target.chunk), max(k, target.chunk))
    total = weights + kv + activations
    share = total / available
    figures = {"weights_bytes": weights, "kv_cache_bytes": kv, "activation_bytes": activations,
               "total_bytes": total, "available_bytes": available, "share": share, "context": engine.context,
               "cache_slots": slots}
    line = (f"weights {weights / 2**30:.2f} GiB + KV cache {kv / 2**30:.2f} GiB ({engine.context} tokens x {slots} "
            f"kept sequences) + "
            f"activations {activations / 2**30:.2f} GiB = {total / 2**30:.2f} GiB of {available / 2**30:.2f} GiB "
            f"({100 * share:.0f}%)")
    if share > 1:
        return Finding("memory", "error", f"{line}: it does not fit; lower --ctx, use --weights int4, or a "
                                          "smaller draft", figures)
    if share > WARN_SHARE:
        return Finding("memory", "warn", f"{line}: above {100 * WARN_SHARE:.0f}%, other programs may push it "
                                         "out; lower --ctx or use --weights int4", figures)
    return Finding("memory", "ok", line, figures)


def memory_plan(plan) -> Finding:
    """The memory plan made before loading (weights/memory.py): what each part will take on the device, whether it
    fits, and above 90% what to lower."""
    figures = {"device": plan.device, "capacity_bytes": plan.capacity, "free_bytes": plan.free,
               "total_bytes": plan.used, "share": plan.share,
               "items": [{"what": i.what, "bytes": i.nbytes, "detail": i.detail} for i in plan.items]}
    parts = ", ".join(f"{i.what} {i.nbytes / 2**30:.2f}" for i in plan.items)
    line = (f"{parts} GiB = {plan.used / 2**30:.2f} GiB of {plan.capacity / 2**30:.1f} GiB on {plan.device} "
            f"({100 * plan.share:.0f}%); no layer is offloaded")
    if not plan.fits:
        return Finding("memory plan", "error", say(plan.refusal()), figures)
    if plan.warning() is not None:
        return Finding("memory plan", "warn", f"{line}: {say(plan.warning())}", figures)
    return Finding("memory plan", "ok", line, figures)


def heads(target, drafts: list, engine) -> Finding | None:
    """A drafter built over the target's states (an EAGLE-3 head, a DFlash drafter): its weights' format (below int8
    such heads lose most of their acceptance: other engines' users saw it fall to ~0), and its caches against the
    target's (the target's states it reads and its own keys and values take the context's room). None without
    one."""
    from quickdraft.speculative.dflash import HeadModel

    head = next((m for m in drafts if isinstance(m, HeadModel)), None)
    if head is None:
        return None
    own = engine.drafter.cache_bytes() if engine.drafter is not None else 0
    context = kv_bytes(engine.cache)
    figures = {"weights": head.weights, "drafter_cache_bytes": own, "target_kv_bytes": context,
               "context": engine.context}
    name = head.name.rstrip("/").rsplit("/", 1)[-1]
    if head.weights == "int4":
        return Finding("draft head", "warn", f"{name} runs in int4: heads over the target's states quantized below "
                                             "int8 lose most of their acceptance; use --draft-weights int8 (auto "
                                             "gives heads int8)", figures)
    line = (f"{name} in {head.weights}; its caches take {own / 2**20:.1f} MiB beside the target's "
            f"{context / 2**20:.1f} MiB KV cache for {engine.context} tokens")
    if own > context:
        return Finding("draft head", "warn", f"{line}: more than the context itself, room a longer --ctx would "
                                             "use; lower --ctx, or drop the head for ngram", figures)
    return Finding("draft head", "ok", line, figures)


def tokenizers(target, draft) -> Finding:
    if draft is None:
        return Finding("tokenizer", "ok", "no draft model: n-gram lookup and built-in MTP layers draft in the "
                                          "target's own vocabulary")
    if draft.tokenizer is None and type(draft.config).__name__ == "Eagle3Config":  # an EAGLE-3 head: d2t maps
        # its tokens
        cfg, V = draft.config, target.config.vocab_size
        if cfg.vocab_size != V:
            return Finding("tokenizer", "error", f"the head maps its tokens onto a vocabulary of {cfg.vocab_size}; the "
                                                 f"target has {V}: it was trained for another target")
        return Finding("tokenizer", "ok", f"the head proposes {cfg.draft_vocab} of the target's {V} tokens"
                       + (" (its d2t map)" if cfg.draft_vocab < V else ""))
    if draft.tokenizer is None:  # a Gemma 4 assistant without one, a DFlash drafter: it scores the target's tokens
        level = "ok" if draft.config.vocab_size == target.config.vocab_size else "error"
        return Finding("tokenizer", level, f"the drafter scores {draft.config.vocab_size} tokens of the target's "
                                           f"{target.config.vocab_size}" + ("" if level == "ok" else
                                                                             ": it was trained for another target"))
    try:
        shared = check_compatible(target.tokenizer, draft.tokenizer, target.config.vocab_size, draft.config.vocab_size)
    except QuickdraftError as e:
        return Finding("tokenizer", "error", str(e))
    t_size, d_size = target.tokenizer.vocab_size, draft.tokenizer.vocab_size
    if t_size == d_size:
        return Finding("tokenizer", "ok", f"the draft's vocabulary matches the target's ({shared} tokens)")
    return Finding("tokenizer", "ok", f"the draft's vocabulary ({d_size} tokens) matches the target's ({t_size}) on "
                   f"the {shared} they share; the draft never proposes the others")


def sampler(drafter, vocab: int, engine=None) -> Finding:
    """The draft samples from the same processed distribution as the target: propose under top-k 3 and
    temperature 0.7 and check that each drafted position has at most 3 candidates, summing to 1. A drafter that
    reads the target's hidden states (mtp) reads them from `engine`'s cache, after its prefill of the sequence."""
    if not drafter.samples:
        return Finding("sampler", "ok", f"{drafter.name} drafts deterministically: verification treats its drafts "
                                        "as one-hot")
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=8)
    seq = [1, 2, 3, 4]  # no repeats: a drafter with n-gram lookup in front leaves the proposal to its model
    pending = seq
    if drafter.reads_hidden and engine is not None:
        for _ in engine.generate(seq, SamplingParams(max_tokens=1), SpeculationConfig(draft_max=0)):
            pass  # the target's pass over seq: its hidden states in the engine's cache
        pending = seq + [5]  # a round's sequence: the target has run seq, its next token pending
    drafter.begin(seq)
    proposal = drafter.propose(pending, lambda source: 3, params, torch.Generator().manual_seed(0))
    q = proposal.q_draft
    candidates = (q > 0).sum(-1).tolist() if q is not None else []
    ok = q is not None and max(candidates) <= 3 and torch.allclose(q.sum(-1), torch.ones(len(q)), atol=1e-4)
    figures = {"candidates_per_position": candidates}
    if ok:
        return Finding("sampler", "ok", "the draft samples with the target's settings (top-k 3 gave at most 3 "
                                        "candidates per drafted position)", figures)
    return Finding("sampler", "error", "the draft ignores the sampling settings it was given: its proposals "
                                       "would be rejected more often than they should", figures)


def speculation(engine, prompt: list[int], n: int = 32) -> Finding:
    """A short greedy run with speculation: acceptance above zero, and the policy's predicted speed-up."""
    if engine.drafter is None:
        return Finding("speculation", "warn", "no draft: speculation is off; give --draft")
    spec = SpeculationConfig(draft_max=engine.speculation.draft_max, adaptive=True, draft_min=1)
    n = min(n, engine.context // 2)
    prompt = prompt[-(engine.context - n):]  # a small --ctx still gets its check
    params = SamplingParams(max_tokens=n, stop_at_eos=False)
    for _ in engine.generate(prompt, SamplingParams(max_tokens=6), SpeculationConfig(draft_max=0)):
        pass  # plain steps: the policy's measure of a target step, for the prediction
    events = list(engine.generate(prompt, params, spec))
    stats = events[-1].stats
    policy = engine.policy
    figures = {"acceptance_rate": stats.acceptance_rate, "tokens_per_round": stats.mean_accepted_length,
               "rounds": stats.rounds, "policy": stats.policy}
    if stats.rounds == 0 or stats.draft_n_accepted == 0:
        return Finding("speculation", "error", f"speculation is not working: {stats.draft_n} drafted, "
                                               f"{stats.draft_n_accepted} accepted; check that the draft belongs "
                                               "to the target's family", figures)
    predicted = None
    measured = [s for s, _ in stats.sources.most_common() if s in policy.t_draft]
    if policy.t_plain and measured:
        source = measured[0]  # the source that drafted most rounds
        best = max(range(1, engine.speculation.draft_max + 1), key=lambda k: policy.predicted_rate(source, k))
        predicted = policy.predicted_rate(source, best) * policy.t_plain
        figures.update(predicted_speedup=predicted, best_k=best, source=source)
    tail = f"; predicted speed-up {predicted:.2f}x ({figures['source']}, k = {figures['best_k']})" if predicted else ""
    level = "warn" if predicted is not None and predicted < 1 else "ok"
    advice = " (below 1x: the policy will decode plainly; try a smaller draft)" if level == "warn" else ""
    return Finding("speculation", level, f"active: {100 * stats.acceptance_rate:.0f}% of drafts accepted, "
                                         f"{stats.mean_accepted_length:.2f} tokens per round{tail}{advice}", figures)


def run(llm, draft, available: int | None = None, prompt: list[int] | None = None,
        planned: Finding | None = None) -> tuple[list[Finding], Engine]:
    """Every check for llm's target with `draft` (a Draft), the memory budget against `available` bytes (else the
    device's), after `planned` (the memory plan's finding, made before loading); the engine the checks ran (its
    drafter None when the draft cannot speak for the target)."""
    from quickdraft.tools.prompts import encoded

    target = llm.target
    drafts = llm.draft_models(draft)
    first = drafts[0] if drafts else None
    tokenizer = tokenizers(target, first)
    findings = [planned] if planned is not None else []
    findings += [placement(target.model, target.device, "target")]
    findings += [placement(m.model, m.device, "draft") for m in drafts]
    findings += [kernels(target, *drafts), exactness(target), machine_defaults(target), loading(target, *drafts),
                 draft_device(target.device, first.device if first else None), tokenizer]
    resolved = llm.drafts.resolve(draft)
    engine = llm.engine_for(resolved if tokenizer.level != "error" else NONE, llm.engine.speculation)
    drafter = engine.drafter
    findings.append(memory(target, drafts, engine, available or device_memory(target.device)))
    head = heads(target, drafts, engine)
    if head is not None:
        findings.append(head)
    if drafter is not None:
        findings.append(sampler(drafter, target.config.vocab_size, engine))
        findings.append(speculation(engine, prompt or encoded(target.tokenizer, ["code-en"])["code-en"]))
    else:
        usable = resolved.kind == "none"
        findings.append(Finding("speculation", "warn" if usable else "error",
                                "no usable draft: speculation is off" + ("" if usable else " (see the tokenizer check)")))
    return findings, engine
