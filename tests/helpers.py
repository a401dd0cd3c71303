"""Helpers shared by the tests (fixtures are in conftest.py): builders for tiny random models (Hugging Face
directories and GGUF files written with the gguf writer), the command line as a subprocess, and shared checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GT, GGUFWriter, quants

# A prompt with repeats, so that n-gram lookup finds matches
PROMPT = [5, 17, 250, 3, 99, 42, 7, 5, 17, 250, 3, 11, 64, 128, 5, 17]


def tokens_of(engine, params, prompt=PROMPT):
    """A generation's tokens and its last event (finish reason, timings, stats)."""
    events = list(engine.generate(prompt, params))
    return [e.token for e in events if e.token is not None], events[-1]


_PLAIN: dict = {}


def plain_tokens(target, params, prompt=PROMPT, answer=tokens_of) -> list:
    """Plain decoding's answer (answer(engine, params, prompt)[0]: tokens_of's tokens by default) on target, decoded
    once per model file, format, dtype, sampling, prompt and thread count: every drafter checked against it meets the
    same answer."""
    from quickdraft.engine import Engine

    key = (str(target.path), target.weights, str(target.model.dtype), repr(params), tuple(prompt),
           torch.get_num_threads(), answer)
    if key not in _PLAIN:
        _PLAIN[key] = answer(Engine(target, 256), params, prompt)[0]
    return _PLAIN[key]


def run(*args, env=None):
    """`quickdraft ARGS` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "quickdraft", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def cli(*args):
    """`quickdraft ARGS` in this process (cli.main, stdout and stderr captured, the exit status as returncode): the
    command line's own code without a new interpreter importing torch for each call (2-3 s here). `run` keeps the
    tests that need a real process: the README's commands, streaming to a pipe, --debug's traceback, serve."""
    import contextlib
    import io

    from quickdraft.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["quickdraft", *args], code or 0, out.getvalue(), err.getvalue())


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def lark_chain(n: int) -> str:
    """A Lark grammar of n + 2 rules, each the next's prefix: a few thousand crash llguidance."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "a"\n'


def ref_chain(n: int) -> dict:
    """A JSON schema whose $ref lead through n definitions."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def drafter(kind, target, draft, p_min=0.0, capacity=256):
    """A drafter of each kind over tiny loaded models: draft (the draft model), self (the target drafting for
    itself), ngram, combined (n-gram lookup, then the draft model)."""
    from quickdraft.speculative.combined import CombinedDrafter
    from quickdraft.speculative.draft_model import DraftModelDrafter
    from quickdraft.speculative.ngram import NgramDrafter

    model = DraftModelDrafter(target if kind == "self" else draft, target.config.vocab_size, capacity, p_min)
    return {"draft": model, "self": model, "ngram": NgramDrafter(), "combined": CombinedDrafter(NgramDrafter(), model)}[kind]



def tiny_hf_config(arch: str, vocab: int = 320, layers: int = 2, **sizes):
    """sizes: hidden_size, intermediate_size, ... in place of the tiny defaults (rows of 256 for K-quant blocks)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2) | sizes
    if arch == "llama":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(rope_theta=1000000.0, **common)
    if arch == "qwen3":  # head_dim 32 != hidden/heads = 16: the explicit head size must be honoured
        return transformers.Qwen3Config(rope_theta=1000000.0, head_dim=32, **common)
    raise ValueError(arch)


def tiny_hf_model(arch: str, seed: int = 0, tie: bool = False, vocab: int = 320, layers: int = 2,
                  logit_scale: float = 1.0, **sizes):
    """A random model; logit_scale > 1 makes its next-token distributions peaked, like a trained model's."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, vocab, layers, **sizes)
    cfg.tie_word_embeddings = tie
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make every parameter matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def save_hf_dir(model, path: Path) -> Path:
    """save_pretrained plus a word-level tokenizer.json naming every id (t0, t1, ...)."""
    from tokenizers import Tokenizer, models

    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def byte_level_vocab(size: int) -> list[str]:
    """GPT-2's byte-to-unicode alphabet, padded with filler tokens to `size`."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for c in cs]
    return tokens + [f"<extra_{i}>" for i in range(size - len(tokens))]


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def converter_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows for llama-arch files, as written there."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(model, path: Path, arch: str | None = None, extra_tensors=(),
                       chat_template: str | None = None, eos: bool = False, table_type=None,
                       layer_types: dict | None = None, metadata: dict | None = None) -> Path:
    """Write an HF model as llama.cpp's converter would (F32 tensors, Q/K rows permuted for llama).

    extra_tensors: (name, raw array, gguf type) triples added as they are; eos: the last id becomes the
    control token <|endoftext|>, the end-of-generation token; table_type: a block type (e.g. Q8_0) the
    embedding table is quantized to with gguf's own quantizer; layer_types: {a layer tensor's GGUF name
    suffix ("ffn_down.weight"): block type} for tensors quantized the same way (the rest stay F32); metadata:
    values written in place of the model's (block_count, embedding_length, head_count), for broken files.
    """
    cfg = model.config
    arch = arch or cfg.model_type
    meta = {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
            "head_count": cfg.num_attention_heads, **(metadata or {})}
    w = GGUFWriter(str(path), arch)
    w.add_block_count(meta["block_count"])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(meta["embedding_length"])
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(meta["head_count"])
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    tokens, types = byte_level_vocab(cfg.vocab_size), [1] * cfg.vocab_size
    if eos:
        tokens[-1], types[-1] = "<|endoftext|>", 3
        w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([])
    if chat_template:
        w.add_chat_template(chat_template)
    for name, t in model.state_dict().items():
        t = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            parts = name.split(".")
            layer, rest = parts[2], ".".join(parts[3:])
            gname = f"blk.{layer}.{_GGUF_LAYER[rest]}"
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
                t = converter_permute(t, heads)
        qtype = table_type if gname == "token_embd.weight" else (layer_types or {}).get(gname.split(".", 2)[-1])
        if qtype in K_QUANTS:  # gguf's Python quantizer cannot write these: random blocks, not the model's values
            w.add_tensor(gname, random_blocks(qtype, *t.shape, np.random.default_rng(0)), raw_dtype=qtype)
            continue
        if qtype is not None:
            w.add_tensor(gname, quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
            continue
        w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
    for name, raw, qtype in extra_tensors:
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Byte offsets of the float16 scale fields in each block (random bytes there could be inf/NaN).
F16_FIELDS = {GT.Q8_0: [0], GT.Q4_0: [0], GT.Q4_1: [0, 2], GT.Q5_0: [0], GT.Q5_1: [0, 2],
              GT.Q4_K: [0, 2], GT.Q5_K: [0, 2], GT.Q6_K: [208]}
K_QUANTS = (GT.Q4_K, GT.Q5_K, GT.Q6_K)


def random_blocks(qtype, rows, cols, rng) -> np.ndarray:
    """Random quantized bytes with finite scales: (rows, bytes per row) uint8."""
    size, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // size, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def add_noise(model, share: float = 0.2, seed: int = 1):
    """model's weights plus seeded noise of `share` of each tensor's spread, in place: a draft that agrees with the
    model often but not always (commits and rollbacks both). Returns the model."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(share * p.std() * torch.randn_like(p))
    return model


def target_and_noisy_draft(directory: Path, config):
    """A tiny qwen2 target and a draft that agrees with it often but not always (its weights plus noise),
    both loaded with `config`."""
    from quickdraft.weights.loader import load_model

    target = load_model(str(save_hf_dir(tiny_hf_model("qwen2", seed=0, logit_scale=20), directory / "t")), config,
                        False)
    draft_hf = add_noise(tiny_hf_model("qwen2", seed=0, logit_scale=20))
    return target, load_model(str(save_hf_dir(draft_hf, directory / "d")), config, False)


def byte_level_pair(directory: Path, config, **sizes):
    """A tiny llama target with a byte-level vocabulary and an end-of-text token, as GGUF (text in, text out:
    constraints and chat prompts work), and a draft that agrees with it often but not always (sizes: as
    tiny_hf_config's)."""
    from quickdraft.weights.loader import load_model

    hf = tiny_hf_model("llama", seed=3, logit_scale=4, **sizes)
    target = load_model(str(write_gguf_from_hf(hf, directory / "t.gguf", eos=True)), config, False)
    add_noise(hf)
    return target, load_model(str(write_gguf_from_hf(hf, directory / "d.gguf", eos=True)), config, False)


def check_speedups(rows, row):
    """The row's speed-ups follow from its own measurements (no speed is asserted: these machines are shared):
    measured = its tok/s over plain's on the prompt; predicted = E[L] / (v(k) + k r), E[L] within 1 .. k + 1."""
    plain = next(r for r in rows if r["prompt"] == row["prompt"] and r["source"] == "none")
    assert row["speedup"] == pytest.approx(row["decode_tok_s"] / plain["decode_tok_s"])
    m = row["model"]
    assert 1 <= m["expected_tokens_per_round"] <= m["k"] + 1 and row["v_k"] > 0 and row["r"] > 0
    assert row["predicted_speedup"] == pytest.approx(m["expected_tokens_per_round"] / (row["v_k"] + m["k"] * row["r"]))


def check_second_token_follows_the_target(target, draft, draws: int = 800, prompt=(1, 2, 3)):
    """Unseeded rejection sampling with k = 1 (target and draft LoadedModels of a small vocabulary V): the token a
    round emits after the target's first is distributed as the target's exact two-step distribution (every first
    token t1 weighed by its probability, the second from the target after it), by a chi-square test."""
    from quickdraft import sampling
    from quickdraft.config import SamplingParams, SpeculationConfig
    from quickdraft.engine import Engine
    from quickdraft.runtime.kv_cache import KVCache
    from quickdraft.speculative.draft_model import DraftModelDrafter
    from quickdraft.tools.verify import chi_square

    V, device, prompt = target.config.vocab_size, target.device, list(prompt)
    params = SamplingParams(temperature=1.0, max_tokens=3, stop_at_eos=False)
    exact = torch.zeros(V, dtype=torch.float64)
    with torch.no_grad():
        cache = KVCache.for_model(target.model, 16)
        p1 = sampling.process(target.forward(torch.tensor([prompt], device=device), cache, last_only=True)[0],
                              params)[0].double().cpu()
        for t1 in range(V):
            cache.rollback(len(prompt))
            p2 = sampling.process(target.forward(torch.tensor([[t1]], device=device), cache)[0], params)[0]
            exact += p1[t1] * p2.double().cpu()
    engine = Engine(target, 16, DraftModelDrafter(draft, V, 16), SpeculationConfig(draft_max=1, adaptive=False))
    counts = torch.zeros(V, dtype=torch.float64)
    torch.manual_seed(0)
    for _ in range(draws):
        events = list(engine.generate(prompt, params))
        tokens = [e.token for e in events if e.token is not None]
        counts[tokens[1]] += 1
    assert events[-1].stats.rounds >= 1
    _, dof, p_value = chi_square(counts, exact)
    assert dof >= 3 and p_value > 1e-3, (counts / draws, exact)


def two_and_three_step(target, prompt: list[int], params) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distributions (float64, over its vocabulary) of the second and third tokens after prompt
    under params (the first drawn too): summed over every first and second token of probability above 1e-9, each a
    one-token pass from the cache rolled back. For the chi-square tests of speculation verifying chains of 2."""
    from quickdraft import sampling
    from quickdraft.runtime.kv_cache import KVCache

    def dist(cache, tokens):
        return sampling.process(target.forward(torch.tensor([tokens]), cache, last_only=True)[0], params)[0].double()

    V = target.config.vocab_size
    second, third = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    with torch.no_grad():
        cache = KVCache.for_model(target.model, len(prompt) + 2)
        p1 = dist(cache, prompt)
        for t1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
            cache.rollback(len(prompt))
            p2 = dist(cache, [t1])
            second += p1[t1] * p2
            for t2 in torch.nonzero(p2 > 1e-9).flatten().tolist():
                cache.rollback(len(prompt) + 1)
                third += p1[t1] * p2[t2] * dist(cache, [t2])
    return second, third


def assert_second_and_third_follow(counts: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor]) -> None:
    """counts (2, V) of the second and third tokens drawn follow the exact distributions (chi-square, p > 1e-3)."""
    from quickdraft.tools.verify import chi_square

    for i, want in enumerate(exact):
        _, dof, p_value = chi_square(counts[i], want)
        assert dof >= 3 and p_value > 1e-3, (i, counts[i] / counts[i].sum(), want)


def in_a_batch(engine, prompts: list[list[int]], params: list) -> tuple[list[list[int]], list]:
    """The prompts run side by side in one Batch of the engine (every one admitted at once): each one's tokens, and
    the sequences (their stats)."""
    from quickdraft.engine import Batch, Halt

    batch = Batch(engine, len(prompts))
    got: dict[int, list[int]] = {}
    sequences = [batch.add(prompt, p, None, Halt()) for prompt, p in zip(prompts, params)]

    def deliver(s, event):
        assert not isinstance(event, Exception), event
        if event.token is not None:
            got.setdefault(sequences.index(s), []).append(event.token)

    while batch.active:
        batch.step(deliver)
    return [got.get(i, []) for i in range(len(prompts))], sequences


def second_and_third_drawn(engine, prompt: list[int], params, vocab: int, draws: int = 500) -> tuple:
    """Counts (2, vocab) of the second and third tokens of `draws` unseeded generations (the first round verifying a
    chain of 2 drafts, asserted), and the drafts accepted in all: what assert_second_and_third_follow judges."""
    counts = torch.zeros(2, vocab, dtype=torch.float64)
    torch.manual_seed(0)
    accepted = 0
    for _ in range(draws):
        events = list(engine.generate(prompt, params))
        tokens = [e.token for e in events if e.token is not None]
        counts[0, tokens[1]] += 1
        counts[1, tokens[2]] += 1
        accepted += events[-1].stats.draft_n_accepted
        assert events[-1].stats.k_history[0] == 2  # the first round verified a chain of 2
    return counts, accepted


def assert_resent_and_batched_equal_plain(target, drafter_for) -> None:
    """A drafter's answers equal plain decoding's with a prompt sent twice to one engine (the second reusing the
    first's positions, and the drafter what it holds of them) and with three sequences in one batch (greedy and
    seeded), and it drafted in both. drafter_for(speculation): a fresh drafter."""
    from quickdraft.config import SamplingParams, SpeculationConfig
    from quickdraft.engine import Engine

    spec = SpeculationConfig(draft_max=4, adaptive=False)
    params = SamplingParams(max_tokens=20, stop_at_eos=False)
    plain, _ = tokens_of(Engine(target, 256), params, PROMPT * 2)
    engine = Engine(target, 256, drafter_for(spec), spec)
    for _ in range(2):
        ours, final = tokens_of(engine, params, PROMPT * 2)
        assert ours == plain and final.stats.draft_n > 0
    assert final.timings.cache_n > 0
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], PROMPT[3:] * 3]
    params = [SamplingParams(max_tokens=20, stop_at_eos=False),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, stop_at_eos=False),
              SamplingParams(max_tokens=16, stop_at_eos=False)]
    want = [tokens_of(Engine(target, 256), p, prompt)[0] for prompt, p in zip(prompts, params)]
    got, sequences = in_a_batch(Engine(target, 256, drafter_for(spec), spec, slots=4), prompts, params)
    assert got == want and sum(s.stats.draft_n for s in sequences) > 0
