"""Mixture-of-experts models (qwen3_moe; qwen3_5_moe: the hybrid with routed and shared experts), on tiny random
configurations: logits against HF transformers, a token's output independent of the tokens computed beside it (batch
invariance), and greedy speculation equal to plain decoding in bf16 and in the quantized CPU formats."""


import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.models.transformer import MoE
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.speculative.ngram import NgramDrafter
from quickdraft.weights.loader import load_model
from tests.helpers import PROMPT, add_noise, save_hf_dir, tokens_of as run

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)


def tiny_moe(arch: str, seed: int = 0, logit_scale: float = 1.0, dense: bool = True):
    """qwen3_moe: 3 layers, the middle one dense (mlp_only_layers; all MoE without dense), 8 experts of which 2 per token, renormalised;
    qwen3_5_moe: the hybrid (3 Gated DeltaNet layers, 1 gated attention) with 8 routed experts and a shared one."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=96, num_hidden_layers=3, head_dim=16,
                                          decoder_sparse_step=1, mlp_only_layers=[1] if dense else [],
                                          norm_topk_prob=True)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**common, shared_expert_intermediate_size=48, num_hidden_layers=4,
                                                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                                linear_key_head_dim=16, linear_value_head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # qwen3_5_moe's norms are zero-centred (1 + w), but its linear layers' gated norm
                centre = 1.0 if arch == "qwen3_moe" or "linear_attn.norm" in name else 0.0
                p.copy_(centre + 0.1 * torch.randn_like(p))
            elif name.endswith(("dt_bias", "mlp.gate.weight", "gate_up_proj", "down_proj")):
                p.copy_(0.2 * torch.randn_like(p))  # routers and experts that differ from each other
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_logits_equal_transformers(tmp_path, arch):
    model = tiny_moe(arch)
    ours = load_model(str(save_hf_dir(model, tmp_path)), F32, progress=False)
    cfg = ours.config
    assert cfg.n_experts == 8 and cfg.experts_per_token == 2 and cfg.norm_topk
    assert cfg.dense_layers == ((1,) if arch == "qwen3_moe" else ())
    assert (cfg.shared_expert_ffn_dim == 48) == (arch == "qwen3_5_moe")
    tokens = torch.randint(0, 320, (1, 100), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(tokens).logits[0]
        whole = ours.model(tokens, KVCache.for_model(ours.model))[0]
        cache = KVCache.for_model(ours.model)
        steps = torch.cat([ours.model(tokens[:, :10], cache)[0]] +
                          [ours.model(tokens[:, i:i + 1], cache)[0] for i in range(10, 100)])
    for label, got in (("prefill", whole), ("steps", steps)):
        err = float((got - want).abs().max())
        print(f"{arch}: max |logit difference| against transformers, {label}: {err:.2e}")
        assert err <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.fixture(scope="module", params=["bf16", "int8", "int4"])
def pair(request, tmp_path_factory):
    """A tiny qwen3_moe target and a noisy copy as its draft, bf16 activations, weights in the format asked."""
    config = EngineConfig(device="cpu", dtype="bfloat16", weights=request.param, max_context=256, weight_cache=False)
    root = tmp_path_factory.mktemp(f"moe-{request.param}")
    target = load_model(str(save_hf_dir(tiny_moe("qwen3_moe", logit_scale=20), root / "t")), config, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_moe("qwen3_moe", logit_scale=20), 0.15), root / "d")), config,
                       False)
    return request.param, target, draft


def test_a_tokens_expert_output_does_not_depend_on_the_tokens_beside_it(pair):
    """Row i of a MoE layer over 9 tokens equals the same token alone, bit for bit, though the experts compute the
    rows routed to them together."""
    fmt, target, _ = pair
    moe = next(b.feed_forward for b in target.model.layers if isinstance(b.feed_forward, MoE))
    if fmt != "bf16":
        assert type(moe.experts[0].w13).__name__ != "Linear", "the experts are in the quantized format"
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        together = moe(x)
        for i in range(9):
            assert torch.equal(moe(x[:, i:i + 1])[0, 0], together[0, i]), (fmt, i)


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_greedy_speculative_equals_plain(pair, kind):
    fmt, target, draft = pair
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain_engine = Engine(target, 256)
    prompt = PROMPT + run(plain_engine, params)[0] + PROMPT if kind == "ngram" else PROMPT
    plain, _ = run(plain_engine, params, prompt)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 256) if kind == "draft" else NgramDrafter()
    for spec in (SpeculationConfig(draft_max=3, adaptive=False), SpeculationConfig(draft_max=8)):
        ours, final = run(Engine(target, 256, drafter, spec), params, prompt)
        assert ours == plain, (fmt, kind, spec)
        assert final.stats.rounds > 0 and final.stats.draft_n > 0


def test_a_hybrid_moe_speculates_exactly(tmp_path):
    """qwen3_5_moe: recurrent state and experts together; greedy speculative output equals plain in bf16."""
    config = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
    target = load_model(str(save_hf_dir(tiny_moe("qwen3_5_moe", logit_scale=20), tmp_path / "t")), config, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_moe("qwen3_5_moe", logit_scale=20), 0.15), tmp_path / "d")),
                       config, False)
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    ours, final = run(Engine(target, 256, DraftModelDrafter(draft, 320, 256), SpeculationConfig(draft_max=4,
                                                                                            adaptive=False)), params)
    assert ours == plain and 0 < final.stats.draft_n_accepted < final.stats.draft_n


def test_exactness_is_claimed_only_where_every_linear_layer_runs_on_an_exact_path(tmp_path):
    """A mixture of experts keeps its router in bf16 (it decides which experts run): where PyTorch's bf16 GEMM is
    emulated (a CPU without AVX-512), that layer is not proven row-invariant, and the path says so, naming the
    routers (and any layer of a shape the int kernels refuse); with AVX-512 oneDNN's is; a dense model is claimed exact
    exactly where none of its layers is off the path."""
    from quickdraft.quant import vnni
    from quickdraft.runtime import plan
    from tests.test_prefix_reuse import build

    if not vnni.available():
        pytest.skip("quickdraft's CPU kernels do not run here")
    bf16 = EngineConfig(device="cpu", dtype="bfloat16", weights="int8", max_context=256)
    moe = load_model(str(save_hf_dir(tiny_moe("qwen3_moe"), tmp_path / "moe")), bf16, False)
    dense = load_model(str(build("llama3", tmp_path / "dense")), bf16, False)
    off = plan.off_path(moe)
    if vnni.isa_name() == "AVX2":
        assert any(name.endswith("router") for name in off), off  # (and here experts too small for the int kernels)
        assert plan.cpu_path(moe)[1] is False and "NOT proven" in plan.cpu_path_line(moe)
        assert off[0] in plan.cpu_path_line(moe)
    else:
        assert off == [] and plan.cpu_path(moe)[1] is True
    dense_off = plan.off_path(dense)
    assert plan.cpu_path(dense)[1] is (not dense_off), dense_off
