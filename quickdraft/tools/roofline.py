"""The memory roofline: decoding reads every weight once per target pass, so its speed limit is
(memory bandwidth) / (bytes read per token). Measures the bandwidth on this machine now, counts the bytes a
model reads per pass in its runtime format, and the verification cost v(k) for k = 1..16, so that the
benchmark can say how close each configuration comes to the limit and why.
"""

from __future__ import annotations

import statistics
import time

import torch

from quickdraft.config import ModelConfig
from quickdraft.config import RopeConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.runtime.timing import sync, timed

# Random-weight stand-ins for real models where the files are not at hand (a GPU machine has no network; a pass's
# speed and a plan's bytes depend on the shapes, not the values): the default pair, and a 27B-class target of
# Qwen3.5-27B's dimensions with all 64 layers as attention layers (the nearest dense model of the size people run
# locally on a 24-32 GB card: about 24B parameters, 15 GiB in int4). Used by scripts/gpu_bench.py and the memory plan's tests.
STAND_INS = {
    "qwen2.5-coder-1.5b": ModelConfig("qwen2", 151936, 1536, 28, 12, 2, 128, 8960, 1e-6, 1e6, 32768, qkv_bias=True),
    "qwen2.5-coder-0.5b": ModelConfig("qwen2", 151936, 896, 24, 14, 2, 64, 4864, 1e-6, 1e6, 32768, qkv_bias=True),
    "dense-27b-class": ModelConfig("qwen3", 248320, 5120, 64, 24, 4, 256, 17408, 1e-6, 1e7, 262144, qk_norm=True),
    # Qwen3.5-27B's layout: 48 Gated DeltaNet layers (16 key and 48 value heads of 128, as we take its config; 26.9B
    # parameters in all), every fourth layer gated attention; run eagerly on CUDA, as the engine serves hybrids
    "hybrid-27b-class": ModelConfig(
        "qwen3_5", 248320, 5120, 64, 24, 4, 256, 17408, 1e-6, 1e7, 262144, qk_norm=True,
        rope=RopeConfig(theta=1e7, rotary_dim=64), attn_output_gate=True,
        layer_types=tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(64)),
        linear_k_heads=16, linear_v_heads=48, linear_k_dim=128, linear_v_dim=128),
    # a hybrid of about Qwen3.5-0.8B's dimensions: 18 Gated DeltaNet layers, every fourth layer gated attention
    "hybrid-0.8b-class": ModelConfig(
        "qwen3_5", 248320, 1024, 24, 8, 2, 256, 3584, 1e-6, 1e7, 262144, qk_norm=True, tie_embeddings=True,
        rope=RopeConfig(theta=1e7, rotary_dim=64), attn_output_gate=True,
        layer_types=tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(24)),
        linear_k_heads=16, linear_v_heads=16, linear_k_dim=128, linear_v_dim=128),
    # a tiny dense model of the default pair's family: the CPU rehearsal of scripts/gpu_check.sh (its paths, not speeds)
    "dense-tiny": ModelConfig("qwen2", 512, 128, 2, 4, 2, 32, 256, 1e-6, 1e6, 4096, qkv_bias=True),
    # a tiny hybrid (3 Gated DeltaNet layers, 1 gated attention): for speeds of the mechanism itself
    "hybrid-tiny": ModelConfig(
        "qwen3_5", 512, 128, 4, 4, 2, 32, 256, 1e-6, 1e7, 4096, qk_norm=True, rope=RopeConfig(theta=1e7, rotary_dim=8),
        attn_output_gate=True, layer_types=("linear", "linear", "linear", "full"), linear_k_heads=2, linear_v_heads=4,
        linear_k_dim=32, linear_v_dim=32),
}


def placeholder_tokenizer(vocab_size: int):
    """A tokenizer of vocab_size placeholder words (t0, t1, ...) for a stand-in model: its ids decode to text."""
    from tokenizers import Tokenizer as Backend, models

    from quickdraft.tokenizer import Tokenizer

    return Tokenizer(Backend(models.WordLevel({f"t{i} ": i for i in range(vocab_size)}, unk_token="t0 ")))


def stand_in(name: str, device, fmt: str = "bf16", context: int = 1024, noise: float = 0.0,
             logit_scale: float = 1.0, source_types: dict | None = None):
    """A LoadedModel of STAND_INS[name]'s shape with random weights, made on the device one module at a time through
    the loader's build_model (converted to fmt as a file's weights would be). noise: the same weights plus noise of
    that share of their spread (a draft that agrees with the model often, not always); logit_scale: the output
    head scaled (peaked distributions, like a trained model's); source_types: the file's tensor types `mixed`
    follows (a Q4_K_M file's: q4_k_m_types)."""
    import time
    from pathlib import Path

    from quickdraft.models.transformer import Transformer
    from quickdraft.weights.loader import LoadedModel, build_model, ready

    cfg, device = STAND_INS[name], torch.device(device)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in Transformer(cfg, context).named_parameters()]
    gen = torch.Generator(device=device).manual_seed(0)
    jitter = torch.Generator(device=device).manual_seed(1)

    def tensors():
        for n, shape in shapes:
            if "norm" in n:
                yield n, torch.ones(shape, dtype=torch.bfloat16, device=device)
            elif n.endswith(("A_log", "dt_bias")):  # decays of a trained model's order: exp(-exp(A) softplus(dt))
                yield n, torch.zeros(shape, dtype=torch.bfloat16, device=device)
            else:
                scale = logit_scale if n == "output.weight" or (n == "tok_embeddings.weight" and cfg.tie_embeddings) \
                    else 1.0
                yield n, random_rows(shape, scale)

    def random_rows(shape, scale: float) -> torch.Tensor:
        """bf16 random weights made a block of rows at a time: float32 copies of a 27B-class head (248k rows) would
        add 10 GB to the load's peak, and the 24 GiB fit measures the loader's peak, not this generator's."""
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        step = max(1, 2**24 // max(1, out[0].numel()))
        for i in range(0, shape[0], step):
            block = out[i:i + step]
            w = torch.randn(block.shape, generator=gen, device=device) * 0.02
            if noise:
                w += noise * 0.02 * torch.randn(block.shape, generator=jitter, device=device)
            block.copy_(w * scale)
        return out

    t0 = time.perf_counter()
    model = build_model(cfg, tensors(), device, context, fmt, torch.bfloat16, source_types)
    lm = LoadedModel(name, Path(name), cfg, model, placeholder_tokenizer(cfg.vocab_size), time.perf_counter() - t0,
                     fmt)
    return ready(lm)


def q4_k_m_types(cfg: ModelConfig) -> dict:
    """The tensor types llama.cpp's Q4_K_M recipe gives a model of cfg's shape (llama-quant.cpp): Q6_K for the output
    head and for attn_v and ffn_down on the layers its use_more_bits rule picks (the first and last eighth, and
    every third between), Q4_K everywhere else; by model name."""
    from gguf import GGMLQuantizationType as T

    n = cfg.n_layers
    types = {"tok_embeddings.weight": T.Q4_K, "output.weight": T.Q6_K}
    for i in range(n):
        more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
        for name in ("attention.wq", "attention.wk", "attention.wo", "feed_forward.w1", "feed_forward.w3"):
            types[f"layers.{i}.{name}.weight"] = T.Q4_K
        for name in ("attention.wv", "feed_forward.w2"):
            types[f"layers.{i}.{name}.weight"] = T.Q6_K if more else T.Q4_K
    return types


def pass_bytes(model, context: int) -> int:
    """Bytes one forward pass of one token reads: every weight in its runtime format (packed codes, scales),
    one row of the embedding table, and the KV cache over `context` positions."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rope_"):
            total += t.shape[-1] * t.element_size()  # one position's row
        elif name.startswith("tok_embeddings."):
            total += t[0].numel() * t.element_size()  # one row (of the table, its codes or its scales)
        else:
            total += t.numel() * t.element_size()
    kv = sum(2 * heads * dim for i, (heads, dim, source) in enumerate(model.kv_layout()) if source == i)
    states = [s for s in model.state_layout() or [] if s is not None]  # a hybrid's recurrent states: read, written
    return (total + kv * context * model.dtype.itemsize
            + sum(2 * heads * k_dim * v_dim * 4 for _, _, heads, k_dim, v_dim in states))


def bandwidth(device: torch.device, mib: int = 512, reps: int = 5) -> float:
    """Memory bandwidth in bytes per second, the best of a copy (read + write) and a reduction (read) over
    buffers far larger than any cache: what a simple stream reaches on this machine now."""
    n = mib * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)

    def best(fn, moved: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return moved / min(times)

    copy = best(lambda: b.copy_(a), 2 * a.numel() * 4)
    read = best(lambda: a.sum(), a.numel() * 4)
    return max(copy, read)


@torch.inference_mode()
def v_curve(target, prompt: list[int], kmax: int = 16, reps: int = 5) -> tuple[float, dict[int, float]]:
    """Seconds of one target pass over one token after the prompt, and v(k) = (pass over k + 1 tokens) / that,
    for k = 1..kmax (the cache rolled back between passes). Each v(k) is the median of reps ratios of a
    k + 1-token pass to a one-token pass timed just before it: on a shared, noisy machine a pair of
    neighbouring passes sees the same conditions, where one baseline for the whole curve would skew it all."""
    model, device = target.model, target.device
    cache = KVCache.for_model(model, len(prompt) + kmax + 2)
    if cache.max_draft is not None:  # a hybrid's recurrent state rolls back at most its kept positions
        kmax = min(kmax, cache.max_draft)
    if target.rows is not None:  # on CUDA a round's pass is at most target.rows rows (Engine.max_draft)
        kmax = min(kmax, target.rows - 1)
    target.forward(torch.tensor([prompt], device=device), cache, last_only=True)
    n = len(prompt)
    feed = torch.tensor([prompt[-1:] * (kmax + 1)], device=device)

    def seconds(k: int) -> float:
        return timed(lambda: target.forward(feed[:, : k + 1], cache), device, lambda: cache.rollback(n))

    for k in (0, kmax):  # warm-up: one-off setup of both shapes
        seconds(k)
    ones, v = [], {}
    for k in range(1, kmax + 1):
        ratios = []
        for _ in range(reps):
            ones.append(seconds(0))
            ratios.append(seconds(k) / ones[-1])
        v[k] = statistics.median(ratios)
    return statistics.median(ones), v


def v_tree(target, prompt: list[int], kmax: int, widths: list[int], reps: int = 3) -> dict[int, dict[int, float]]:
    """width -> {k: a tree pass's seconds over a one-token pass's}: the pass verifying a chain of k drafts and width - 1
    candidates beside its middle one (Transformer.forward_tree; k + width rows), timed as v_curve times chains (each
    ratio against a one-token pass just before it). For the widths and k whose rows fit the cache's room and a
    row-wise pass."""
    from quickdraft.models.transformer import ROWWISE_MAX

    model, device = target.model, target.device
    widest = max(widths, default=1)
    cache = KVCache.for_model(model, len(prompt) + kmax + widest + 1)
    target.forward(torch.tensor([prompt], device=device), cache, last_only=True)
    n = len(prompt)
    one = torch.tensor([[prompt[-1]]], device=device)

    def reset():
        cache.tree = None
        cache.rollback(n)

    out: dict[int, dict[int, float]] = {}
    for width in widths:
        out[width] = {}
        for k in range(1, kmax + 1):
            rows = k + width
            if rows > ROWWISE_MAX:
                break
            depths = list(range(k + 1)) + [(k + 1) // 2] * (width - 1)
            feed = torch.tensor(prompt[-1:] * rows, device=device)
            ratios = []
            for rep in range(reps + 1):  # the first: one-off setup of the shape
                base = timed(lambda: target.forward(one, cache), device, reset)
                tree = timed(lambda: target.forward_tree(feed, depths, k + 1, cache), device, reset)
                if rep:
                    ratios.append(tree / base)
            out[width][k] = statistics.median(ratios)
    return out


def report(target, drafts: list, rows: list[dict], prompt: list[int], kmax: int = 16) -> dict:
    """The roofline of a benchmark run: bandwidth, bytes per pass of the target and of the draft (its models,
    `drafts`), the plain limit, v(k), and per row the bytes read per emitted token and the GB/s achieved (a row
    needs rounds, plain_steps, draft_passes, n_decoded and decode_tok_s)."""
    bw = bandwidth(target.device)
    context = len(prompt) + 64
    t_bytes = pass_bytes(target.model, context)
    d_bytes = sum(pass_bytes(m.model, context) for m in drafts)
    t1, v = v_curve(target, prompt, kmax)
    for r in rows:
        passes = r["rounds"] + r["plain_steps"]
        per_token = (passes * t_bytes + r["draft_passes"] * d_bytes) / max(r["n_decoded"], 1)
        r["bytes_per_token"] = per_token
        r["gb_s"] = per_token * r["decode_tok_s"] / 1e9
        r["bandwidth_share"] = per_token * r["decode_tok_s"] / bw
    return {"bandwidth_gb_s": bw / 1e9, "target_pass_bytes": t_bytes, "draft_pass_bytes": d_bytes,
            "plain_limit_tok_s": bw / t_bytes, "t_pass_s": t1, "v": v,
            "plain_pass_share": (t_bytes / t1) / bw}
