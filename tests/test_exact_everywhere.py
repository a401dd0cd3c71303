"""Exactness beyond the suite's bf16 on two threads: float32 compute (what `--dtype auto` gives a CPU without native
bf16 for float weights), other thread counts, and quickdraft's int8/int4 kernels built for AVX2 (what a CPU without
AVX-512 VNNI runs for quantized weights: these cases run in a process held to AVX2 throughout, PyTorch's and oneDNN's
own ops too, by test_what_a_cpu_without_avx512_runs_is_exact). Speculation (each drafter, chains and trees), prefix
reuse and batching must give the logprobs and tokens plain decoding gives, bit for bit.

Each float32 check here fails on PyTorch's own float32 GEMM and activations (QUICKDRAFT_NO_AVX2=1 runs them: MKL orders
a row's sums by the row and thread counts); quickdraft's fixed-order kernels (quant/avx2.py) make them pass."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.quant import avx2, vnni
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.weights.loader import load_model
from tests import test_batch, test_prefix_reuse
from tests.helpers import PROMPT, add_noise, byte_level_pair, drafter, plain_tokens, save_hf_dir, tiny_hf_model

# name: (compute dtype, threads, weights, the int kernels' build it needs (None: any))
COMPUTE = {"float32-3-threads": ("float32", 3, "bf16", None), "bf16-4-threads": ("bfloat16", 4, "bf16", None),
           "int8-avx2-3-threads": ("bfloat16", 3, "int8", "avx2"),
           "int4-avx2-2-threads": ("bfloat16", 2, "int4", "avx2")}
WIDE = dict(hidden_size=128, intermediate_size=256)  # every layer on the int kernels (K a multiple of 128)
AS_AN_AVX2_CPU = {"QUICKDRAFT_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SCORED = {"greedy": SamplingParams(max_tokens=32, stop_at_eos=False, logprobs=3),
          "seeded": SamplingParams(max_tokens=32, stop_at_eos=False, logprobs=3, temperature=0.9, top_p=0.95, seed=3)}
SPECS = {"fixed-4": SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0),
         "tree": SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0, tree=3),
         "adaptive": SpeculationConfig(draft_max=8)}


@pytest.fixture(scope="module", params=list(COMPUTE))
def compute(request, tmp_path_factory):
    """(config, target, draft): a tiny qwen2 target and its noisy draft in this compute dtype and format, with torch's
    threads set to this count for the module's tests that use it."""
    dtype, threads, weights, isa = COMPUTE[request.param]
    if dtype == "float32" and not avx2.available():
        pytest.skip(f"quickdraft's float32 kernels do not run here: {avx2.unavailable_reason()}")
    if isa is not None and vnni.isa() != isa:
        pytest.skip(f"the {isa} build's cases run in a process of their own "
                    "(test_what_a_cpu_without_avx512_runs_is_exact)")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    config = EngineConfig(device="cpu", dtype=dtype, weights=weights, max_context=256)
    root = tmp_path_factory.mktemp(request.param)
    sizes = WIDE if weights != "bf16" else {}
    target = load_model(str(save_hf_dir(tiny_hf_model("qwen2", seed=0, logit_scale=8, **sizes), root / "t")), config,
                        False)
    noisy = add_noise(tiny_hf_model("qwen2", seed=0, logit_scale=8, **sizes), 0.3)
    draft = load_model(str(save_hf_dir(noisy, root / "d")), config, False)
    assert target.model.dtype == getattr(torch, dtype)
    if weights != "bf16":  # every linear layer on quickdraft's kernels, every layer as one fused step
        assert set(target.plan["linear"]) == {f"{weights} (quickdraft)"}, target.plan
        assert target.plan["fused_layers"] == target.plan["layers"], target.plan
    yield config, target, draft
    torch.set_num_threads(before)


@pytest.mark.skipif(os.environ.get("QUICKDRAFT_ISA") == "avx2", reason="(this is that process)")
def test_what_a_cpu_without_avx512_runs_is_exact():
    """This module's cases on quickdraft's AVX2 kernels, in a process whose PyTorch and oneDNN are held to AVX2 too
    (the instructions a CPU without AVX-512 has): every case runs there and passes."""
    if vnni.BUILDS["avx2"].reason() is not None:
        pytest.skip(f"quickdraft's AVX2 kernels do not run here: {vnni.BUILDS['avx2'].reason()}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "avx2", __file__],
                         env={**os.environ, **AS_AN_AVX2_CPU}, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" in summary, tail


def scored(engine, params, prompt=PROMPT):
    events = list(engine.generate(prompt, params))
    return [(e.token, e.logprob, e.top_logprobs) for e in events if e.token is not None], events[-1].stats


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("case", list(SCORED))
def test_speculation_gives_plain_decodings_logprobs(compute, kind, case):
    """Chains of 4, trees and the adaptive policy, for each drafter: every token and its logprobs as plain decoding
    gives them (a tree's tokens: trees are verified where no logprobs are asked for); the draft model's chains were
    verified past their first token and some were cut (rollbacks)."""
    _, target, draft = compute
    for name, spec in SPECS.items():
        if kind == "ngram" and name == "tree":
            continue  # lookup proposes chains alone
        params = SCORED[case] if name != "tree" else dataclasses.replace(SCORED[case], logprobs=None)
        plain = plain_tokens(target, params, answer=scored)
        ours, stats = scored(Engine(target, 256, drafter(kind, target, draft), spec), params)
        assert ours == plain, (kind, name)
        assert stats.rounds > 0 or (kind, case) == ("ngram", "seeded"), (kind, name)  # sampled text: no repeats
        if kind == "draft" and name == "fixed-4":
            assert max(stats.k_history) == 4 and 0 < stats.draft_n_accepted < stats.draft_n
        if kind == "draft" and name == "tree":
            assert stats.tree_rounds > 0


def test_a_reused_prefix_gives_what_an_empty_cache_gives(compute):
    """Three turns of a conversation, each taking the last from its slot (prefilled and decoded rows reused for a
    longer prompt), with speculation: the answers a cold engine gives without speculation."""
    _, target, draft = compute
    for params in (test_prefix_reuse.GREEDY, test_prefix_reuse.SEEDED):
        plain, _ = test_prefix_reuse.conversation(Engine(target, 256), params, reuse=False)
        spec = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256, 0.0), SPECS["fixed-4"],
                      slots=2)
        ours, reused = test_prefix_reuse.conversation(spec, params)
        assert ours == plain and all(n > len(test_prefix_reuse.SYSTEM) for n in reused[1:]), reused


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_sequence_of_a_batch_gets_what_it_gets_alone(compute, tmp_path, sampled):
    """Five requests through a batch of three (a prefill chunk beside decoding rows, drafts of several sequences
    verified in one pass): each gets the tokens it gets alone."""
    config = compute[0]
    target, draft = byte_level_pair(tmp_path, config, **(WIDE if config.weights != "bf16" else {}))
    reqs = test_batch.requests(target, sampled)
    want = [test_batch.alone(target, draft, "combined", r) for r in reqs]
    got, rows, drafted = test_batch.batched(target, draft, "combined", reqs)
    assert [got[i] for i in range(len(reqs))] == want
    assert max(rows) > 8 and max(drafted) > 0


FAMILIES = ["gemma2", "gemma3", "qwen3_5", "qwen3_5_moe"]  # soft caps and tanh GELU, recurrent states, experts


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_speculates_and_reuses_exactly_in_float32(three_threads, tmp_path, name):
    """The layers other families add (soft caps, tanh GELU, recurrent states, experts) in float32 on three threads:
    the model drafting for itself (chains of 4 verified in 5-row passes; the seeded ones cut) over a reused
    conversation gives plain decoding's answers from an empty cache, greedy and seeded."""
    if not avx2.available():
        pytest.skip(f"quickdraft's float32 kernels do not run here: {avx2.unavailable_reason()}")
    config = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
    lm = load_model(str(test_prefix_reuse.build(name, tmp_path / name)), config, False)
    for params in (test_prefix_reuse.GREEDY, test_prefix_reuse.SEEDED):
        plain, _ = test_prefix_reuse.conversation(Engine(lm, 256), params, reuse=False)
        ours, reused = test_prefix_reuse.conversation(
            Engine(lm, 256, DraftModelDrafter(lm, lm.config.vocab_size, 256, 0.0), SPECS["fixed-4"], slots=2), params)
        assert ours == plain, (name, params.seed)
        assert all(n >= len(test_prefix_reuse.SYSTEM) for n in reused[1:]), reused


def test_a_wide_bf16_layer_gives_each_row_one_result_in_any_pass():
    """oneDNN's bf16 GEMM gives a wide layer's rows other bits in a pass of more than 32 rows (a prefill chunk of 64, a
    large batch) than in a step or a verification: models/transformer.linear runs such passes in blocks of 32."""
    from quickdraft.models.transformer import linear

    torch.manual_seed(0)
    w, x = torch.randn(2048, 640).bfloat16(), torch.randn(70, 640).bfloat16()
    full = linear(x, w)
    for rows in (1, 2, 5, 33, 64, 70):
        assert torch.equal(linear(x[:rows], w), full[:rows]), rows
        assert torch.equal(linear(x[rows - 1:rows], w), full[rows - 1:rows]), rows
