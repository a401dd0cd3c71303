"""Gemma 4's assistant drafter (models/assistant.py, speculative/assistant.py) on tiny random models: its step against
transformers' own Gemma4AssistantForCausalLM fed the same target's hidden states and keys and values (plain head and
the centroid-masked one), and speculation with it exactly plain decoding's (greedy, seeded), through the engine,
tune's replay and doctor."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.errors import QuickdraftError
from quickdraft.models.assistant import TargetKeys
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.speculative.draft import Draft, DraftBuilder
from quickdraft.weights.loader import load_model
from tests.families import save, tiny_model
from tests.helpers import PROMPT, tokens_of as run

F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)


def tiny_assistant(target_config, ordered: bool, seed: int = 4, backbone: int | None = None):
    """A random assistant for tests/families.py's gemma4 (6 layers: sliding ones with 2 key/value heads of 16, full
    ones with 1 of 32, values from the keys): 2 layers of width 32; with ordered embeddings 8 centroids, 2 chosen."""
    import transformers

    torch.manual_seed(seed)
    text = transformers.Gemma4TextConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=5, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1, rms_norm_eps=1e-6,
        rope_parameters=target_config.rope_parameters)
    config = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone or
                                                target_config.hidden_size, use_ordered_embeddings=ordered,
                                                num_centroids=8, centroid_intermediate_top_k=2)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.mul_(4.0)  # peaked distributions: drafts that are sure of themselves
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.1 * torch.randn_like(b))
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(320, generator=torch.Generator().manual_seed(1)))
    return model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    hf = tiny_model("gemma4")
    return hf, save(hf, tmp_path_factory.mktemp("gemma4-target"))


@pytest.fixture(scope="module", params=[False, True], ids=["plain-head", "centroids"])
def assistant_dir(request, target_dir, tmp_path_factory):
    hf_target, _ = target_dir
    model = tiny_assistant(hf_target.config, request.param)
    path = tmp_path_factory.mktemp("assistant")
    model.save_pretrained(path)
    return model, path


def drafter_for(target, path, config, speculation=SpeculationConfig()):
    return DraftBuilder(target, config, 256).drafter(Draft.parse(str(path)), speculation)


def test_a_step_equals_transformers(target_dir, assistant_dir):
    """After the target's pass over 12 tokens (past the sliding window of 5), two chained steps: logits and the
    projected hidden state as transformers' assistant gives them from the target's shared_kv_states and hidden
    state (float32)."""
    hf_target, tdir = target_dir
    hf_assistant, adir = assistant_dir
    tokens = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 311, 64, 128, 1, 200]])
    pending = torch.tensor([[13]])
    with torch.no_grad():
        out = hf_target(tokens, output_hidden_states=True, return_shared_kv_states=True)
        embed = hf_target.get_input_embeddings()
        inputs = torch.cat([embed(pending), out.hidden_states[-1][:, -1:]], dim=-1)
        want, position = [], torch.tensor([[tokens.shape[1]]])
        for _ in range(2):
            got = hf_assistant(inputs_embeds=inputs, position_ids=position, shared_kv_states=out.shared_kv_states)
            want.append((got.logits[0, -1], got.last_hidden_state[0, -1]))
            inputs = torch.cat([embed(got.logits.argmax(-1)), got.last_hidden_state], dim=-1)

        target = load_model(str(tdir), F32, progress=False)
        drafter = drafter_for(target, adir, F32)
        cache = KVCache.for_model(target.model)
        cache.keep_hidden(target.config.dim)
        target.model(tokens, cache)
        assert drafter.layers == [2, 3]  # the target's last own sliding and full layers
        drafter.keys = TargetKeys(cache, drafter.layers, tokens.shape[1])
        drafter.hidden = cache.hidden[tokens.shape[1] - 1].view(1, 1, -1)
        token = 13
        for logits_want, hidden_want in want:
            logits = drafter._step(token)[0, -1]
            errors = (float((logits - logits_want).abs().max()), float((drafter.hidden[0, -1] - hidden_want).abs().max()))
            print(f"assistant step against transformers: logits {errors[0]:.1e}, hidden {errors[1]:.1e}")
            # float32 summed in another order than transformers' (quickdraft's fixed-order kernel): some 100 ulps apart
            # per step, and the second step starts from the first's hidden state (transformers 5.25 gave 3.1e-5 there);
            # a wrong mask, scale or layer is off by 1e-2 and more
            assert errors[0] <= 1e-4 * max(1.0, float(logits_want.abs().max()))
            assert errors[1] <= 1e-4 * max(1.0, float(hidden_want.abs().max()))
            assert int(logits.argmax()) == int(logits_want.argmax())
            token = int(logits.argmax())


@pytest.mark.parametrize("spec", [SpeculationConfig(draft_max=1, adaptive=False),
                                  SpeculationConfig(draft_max=4, adaptive=False), SpeculationConfig()],
                         ids=["fixed-1", "fixed-4", "adaptive"])
def test_greedy_speculative_equals_plain(target_dir, assistant_dir, spec):
    _, tdir = target_dir
    _, adir = assistant_dir
    target = load_model(str(tdir), BF16, progress=False)
    params = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    drafter = drafter_for(target, adir, BF16, spec)
    ours, final = run(Engine(target, 256, drafter, spec), params)
    assert ours == plain
    assert final.stats.rounds > 0 and final.stats.draft_n > 0 and "assistant" in final.stats.sources


def test_trees_of_the_assistants_candidates_equal_plain(target_dir, assistant_dir):
    """--draft-tree: the assistant's chain with alternatives at its least sure position, greedy and seeded."""
    _, tdir = target_dir
    _, adir = assistant_dir
    target = load_model(str(tdir), BF16, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False, tree=3, p_min=0.0)
    for params in (SamplingParams(max_tokens=32, stop_at_eos=False),
                   SamplingParams(temperature=0.9, seed=4, max_tokens=32, stop_at_eos=False)):
        plain, _ = run(Engine(target, 256), params)
        ours, final = run(Engine(target, 256, drafter_for(target, adir, BF16, spec), spec), params)
        assert ours == plain and final.stats.tree_rounds > 0


def test_the_memory_plan_counts_what_the_assistant_holds(target_dir, assistant_dir):
    """The plan made before loading against the built drafter: the assistant keeps no cache of its own, it reads the
    target's hidden states (and its weights are counted beside the target's)."""
    from quickdraft.api import memory_plan

    _, tdir = target_dir
    _, adir = assistant_dir
    target = load_model(str(tdir), BF16, progress=False)
    engine = Engine(target, 256, drafter_for(target, adir, BF16), SpeculationConfig())
    run(engine, SamplingParams(max_tokens=10, stop_at_eos=False))
    plan = memory_plan(str(tdir), Draft.parse(str(adir)), BF16)
    assert [i.what for i in plan.items] == ["target weights", "target KV cache", "draft weights", "draft KV cache",
                                            "activations"]
    assert next(i.nbytes for i in plan.items if i.what == "draft KV cache") == engine.drafter.cache_bytes() > 0


def test_seeded_sampling_and_lookup_in_front_equal_plain(target_dir, assistant_dir):
    _, tdir = target_dir
    _, adir = assistant_dir
    target = load_model(str(tdir), BF16, progress=False)
    spec = SpeculationConfig(draft_max=3, adaptive=False)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), params)
    ours, final = run(Engine(target, 256, drafter_for(target, adir, BF16, spec), spec), params)
    assert ours == plain and 0 < final.stats.draft_n_accepted < final.stats.draft_n  # accepts and rejections
    greedy = SamplingParams(max_tokens=40, stop_at_eos=False)
    plain, _ = run(Engine(target, 256), greedy)
    combined = DraftBuilder(target, BF16, 256).drafter(Draft.parse(f"ngram+{adir}"), spec)
    assert combined.reads_hidden  # the engine attaches its cache through the lookup in front
    ours, final = run(Engine(target, 256, combined, spec), greedy)
    assert ours == plain and "assistant" in final.stats.sources


def test_the_draft_is_recognised_and_replayed_for_tune(target_dir, assistant_dir):
    """--draft DIR is the assistant kind for a gemma4_assistant directory; tune's replay runs the chain a round runs:
    over an output made of the target's first token and the round's own drafts after it, it keeps all of them."""
    _, tdir = target_dir
    _, adir = assistant_dir
    assert Draft.parse(str(adir)).kind == "assistant" and Draft.parse(str(tdir)).kind == "model"
    target = load_model(str(tdir), F32, progress=False)
    spec = SpeculationConfig(draft_max=4, adaptive=False, p_min=0.0)  # no early stop: the replay has none
    drafter = drafter_for(target, adir, F32, spec)
    engine = Engine(target, 256, drafter, spec)
    first, _ = run(engine, SamplingParams(max_tokens=1, stop_at_eos=False), PROMPT)  # the prompt's pass
    proposal = drafter.propose(PROMPT + first, lambda source: 4, SamplingParams(max_tokens=8), None)
    assert len(proposal.tokens) == 4
    offers = drafter.offers(PROMPT, first + proposal.tokens, 4)
    assert offers[1].kept == 4, [o.kept for o in offers]


def test_doctor_checks_the_assistant(target_dir, assistant_dir):
    from quickdraft.tools import doctor

    _, tdir = target_dir
    _, adir = assistant_dir
    target = load_model(str(tdir), BF16, progress=False)
    lm = load_model(str(adir), BF16, progress=False)
    assert lm.tokenizer is None and doctor.tokenizers(target, lm).level == "ok"
    spec = SpeculationConfig(draft_max=3, adaptive=False)
    drafter = drafter_for(target, adir, BF16, spec)
    finding = doctor.sampler(drafter, 320, Engine(target, 256, drafter, spec))
    assert finding.level == "ok", finding.message


def test_an_assistant_for_another_target_is_a_clear_error(target_dir, tmp_path):
    hf_target, tdir = target_dir
    tiny_assistant(hf_target.config, False, backbone=48).save_pretrained(tmp_path)
    target = load_model(str(tdir), BF16, progress=False)
    with pytest.raises(QuickdraftError, match="trained for a target 48 wide"):
        drafter_for(target, tmp_path, BF16)
