"""Tree verification (--draft-tree): a chain with alternative candidates beside it, verified in one target pass.

A tree pass must give each row the logits a pass over its own path gives (Transformer.forward_tree, bit for bit, on
every family whose passes are row-wise), keep the accepted path's keys and values as that path's own pass would have
left them, and accept exactly: greedy and seeded output identical to plain decoding, unseeded output distributed as
the target's (recursive rejection sampling, chi-square), with a draft model and with a DFlash drafter."""

from __future__ import annotations

import pytest
import torch

from quickdraft.config import EngineConfig, SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.runtime.kv_cache import KVCache, TreeRows
from quickdraft.speculative.accept import accept_tree_greedy, accept_tree_sampled
from quickdraft.speculative.draft_model import DraftModelDrafter
from quickdraft.weights.loader import load_model
from tests.helpers import PROMPT, add_noise, save_hf_dir, tiny_hf_model, tokens_of as run
from tests.test_prefix_reuse import build

BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
F32 = EngineConfig(device="cpu", dtype="float32", weights="bf16", max_context=256)
# the pending token, a chain of 3, then leaves: two beside the chain's second node (depth 2), one beside its first
TOKENS = [40, 41, 42, 43, 50, 51, 60]
PARENTS = [-1, 0, 1, 0, 0, -1]  # of the drafted nodes (TOKENS[1:])
DEPTHS = [0, 1, 2, 3, 2, 2, 1]


def _path(row: int) -> list[int]:
    path = [row]
    while path[-1] != 0:
        path.append(PARENTS[path[-1] - 1] + 1)
    return path[::-1]


def _recurrent(cache, n):
    return [t for s in cache.recurrent for t in (s.ssm, s.conv)] if cache.recurrent else []


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "gemma2", "gemma3", "gemma4", "phi3", "qwen3_moe",
                                  "qwen3_5", "qwen3_5_moe"])
def test_each_row_of_a_tree_pass_is_its_paths_own_bit_for_bit(tmp_path, name):
    """Every row's logits are those of a pass over its path alone (the chain's: a chain pass), and keeping a path
    (a leaf's, or the chain's) leaves the cache (keys, values, kept hidden states, a hybrid's recurrent states) as
    that path's pass leaves it."""
    if name == "qwen3_moe":
        from tests.test_moe import tiny_moe

        path = save_hf_dir(tiny_moe(name, logit_scale=20), tmp_path / name)
    else:
        path = build(name, tmp_path / name)
    lm = load_model(str(path), BF16, False)
    model = lm.model
    prompt = [(7 * i + 3) % 300 + 3 for i in range(20)]
    with torch.inference_mode():
        tree = KVCache.for_model(model, 64)
        tree.keep_hidden(model.cfg.dim)
        tree.keep_features([0, model.cfg.n_layers - 1], model.cfg.dim)
        model(torch.tensor([prompt]), tree)
        start = tree.length
        logits = lm.forward_tree(torch.tensor(TOKENS), DEPTHS, 4, tree)
        assert tree.length == start + len(TOKENS)
        alone = KVCache.for_model(model, 64)
        alone.keep_hidden(model.cfg.dim)
        alone.keep_features([0, model.cfg.n_layers - 1], model.cfg.dim)
        model(torch.tensor([prompt]), alone)
        want = model(torch.tensor([TOKENS[:4]]), alone)[0]
        assert torch.equal(logits[:4], want)
        for row in range(4, len(TOKENS)):
            path = _path(row)
            alone.rollback(start)
            want = model(torch.tensor([[TOKENS[r] for r in path]]), alone)[0, -1]
            assert torch.equal(logits[row], want), (name, row)
        for kept in (5, 2):  # a leaf beside the chain's second node; the chain up to its second node
            tree.rollback(start)
            lm.forward_tree(torch.tensor(TOKENS), DEPTHS, 4, tree)
            path = _path(kept)
            TreeRows.commit(tree, start, path)
            alone.rollback(start)
            model(torch.tensor([[TOKENS[r] for r in path]]), alone)
            n = alone.length
            assert tree.length == n
            assert all(torch.equal(a[:, :, :n], b[:, :, :n]) for a, b in zip(tree.tensors(), alone.tensors()))
            assert torch.equal(tree.hidden[:n], alone.hidden[:n])
            assert torch.equal(tree.features[:n], alone.features[:n])
            assert all(torch.equal(a, b) for a, b in zip(_recurrent(tree, n), _recurrent(alone, n)))
            follow = torch.tensor([[7, 8]])  # and the next pass from there is the same
            assert torch.equal(model(follow, tree), model(follow, alone))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_tree_pass_on_the_cpu_kernels_is_each_paths_own(tmp_path, weights):
    """On quickdraft's kernels, where a chain pass runs each decoder layer as one fused call and a tree pass runs the
    layers module by module: every row still bit for bit its path's own pass."""
    import dataclasses

    hf = tiny_hf_model("qwen2", seed=3, vocab=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2)
    lm = load_model(str(save_hf_dir(hf, tmp_path / "m")), dataclasses.replace(BF16, weights=weights), False)
    if lm.plan.get("fused_layers", 0) == 0:
        pytest.skip(f"quickdraft's fused kernels do not run here: {lm.plan}")
    prompt = [(7 * i + 3) % 500 + 3 for i in range(20)]
    with torch.inference_mode():
        tree, alone = KVCache.for_model(lm.model, 64), KVCache.for_model(lm.model, 64)
        for cache in (tree, alone):
            lm.forward(torch.tensor([prompt]), cache)
        start = tree.length
        logits = lm.forward_tree(torch.tensor(TOKENS), DEPTHS, 4, tree)
        for row in range(len(TOKENS)):
            alone.rollback(start)
            path = _path(row)
            want = lm.forward(torch.tensor([[TOKENS[r] for r in path]]), alone)[0, -1]
            assert torch.equal(logits[row], want), row


def test_the_tree_walks():
    """Greedy: the child matching the target's choice is followed; sampled: an accepted alternative's row is walked
    next, and with every child rejected the last token comes from the residual."""
    tokens, parents = [5, 6, 7, 8], [-1, 0, -1, 2]  # chain 5 -> 6, an alternative 7 at the root with a child 8
    assert accept_tree_greedy([5, 6, 9, 0, 0], tokens, parents) == ([5, 6, 9], [0, 1, 2])
    assert accept_tree_greedy([7, 0, 0, 8, 3], tokens, parents) == ([7, 8, 3], [0, 3, 4])
    assert accept_tree_greedy([4, 0, 0, 0, 0], tokens, parents) == ([4], [0])
    V = 10
    p = torch.zeros(5, V)
    p[0, 7] = 1.0  # the target wants 7 at the root, then 8, then 3
    p[3, 8] = 1.0
    p[4, 3] = 1.0
    p[1:3] = 1.0 / V
    q = torch.zeros(4, V)
    q[torch.arange(4), torch.tensor(tokens)] = 1.0
    assert accept_tree_sampled(p, q, tokens, parents, torch.Generator().manual_seed(0)) == ([7, 8, 3], [0, 3, 4])


def test_recursive_rejection_sampling_gives_the_target_distribution():
    """The root's candidates as a tree round makes them: one drawn from the draft's q, then the draft's next most
    likely tokens other than it (deterministic candidates): the token emitted at the root is distributed as p
    (chi-square over 20000 draws), and the alternatives are kept where the chain's draft alone would be rejected."""
    from quickdraft.tools.verify import chi_square

    V = 8
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(2 * torch.randn(V, generator=g), -1)
    q = torch.softmax(p.log() + torch.randn(V, generator=g), -1)  # a draft near the target, not equal to it
    counts = torch.zeros(V, dtype=torch.float64)
    kept_alternative = 0
    for _ in range(20000):
        x = int(torch.multinomial(q, 1, generator=g))
        alternatives = [t for t in q.argsort(descending=True).tolist() if t != x][:2]
        tokens = [x] + alternatives
        q_rows = torch.zeros(3, V)
        q_rows[0] = q
        q_rows[1, alternatives[0]] = q_rows[2, alternatives[1]] = 1.0
        p_rows = torch.stack([p] + [torch.full((V,), 1.0 / V)] * 3)
        out, path = accept_tree_sampled(p_rows, q_rows, tokens, [-1, -1, -1], g)
        counts[out[0]] += 1
        kept_alternative += len(path) > 1 and path[1] > 1
    _, dof, p_value = chi_square(counts, p.double())
    assert dof >= 3 and p_value > 1e-3, (counts / counts.sum(), p)
    assert kept_alternative > 500


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny qwen2 target and a noisy copy as its draft (agreeing often, not always)."""
    directory = tmp_path_factory.mktemp("tree")
    target = load_model(str(save_hf_dir(tiny_hf_model("qwen2", seed=0, logit_scale=8), directory / "t")), BF16, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_hf_model("qwen2", seed=0, logit_scale=8), 0.3),
                                       directory / "d")), BF16, False)
    return target, draft


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_greedy_and_seeded_trees_equal_plain(pair, adaptive):
    target, draft = pair
    spec = SpeculationConfig(draft_max=4, adaptive=adaptive, tree=3, p_min=0.0)
    kept = 0
    for params in (SamplingParams(max_tokens=48, stop_at_eos=False),
                   SamplingParams(max_tokens=48, stop_at_eos=False, repetition_penalty=1.3),
                   SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=48, stop_at_eos=False)):
        plain, _ = run(Engine(target, 256), params)
        drafter = DraftModelDrafter(draft, target.config.vocab_size, 256, 0.0)
        ours, final = run(Engine(target, 256, drafter, spec), params)
        assert ours == plain
        assert final.stats.tree_rounds > 0
        kept += final.stats.tree_alternatives_kept
    assert kept > 0 or adaptive  # fixed: the noisy draft's second choice is the target's often enough


def test_sampled_trees_have_the_target_distribution(tmp_path):
    """Unseeded at T = 0.7, chains of 2 drafts with up to 2 alternatives, over a vocabulary of 24: the second and third
    tokens emitted (both from the one round verifying a tree of depth 2) are distributed as the target's two- and
    three-step distributions (chi-square), and alternatives were kept."""
    from tests.helpers import assert_second_and_third_follow, two_and_three_step

    target = load_model(str(save_hf_dir(tiny_hf_model("qwen2", seed=0, vocab=24, logit_scale=2), tmp_path / "t")),
                        F32, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_hf_model("qwen2", seed=0, vocab=24, logit_scale=2), 0.3),
                                       tmp_path / "d")), F32, False)
    prompt, V = [1, 2, 3], 24
    params = SamplingParams(temperature=0.7, max_tokens=4, stop_at_eos=False)  # a draft budget of 2 after the first
    exact = two_and_three_step(target, prompt, params)
    spec = SpeculationConfig(draft_max=2, adaptive=False, tree=3, p_min=0.0)
    engine = Engine(target, 16, DraftModelDrafter(draft, V, 16, 0.0), spec)
    counts = torch.zeros(2, V, dtype=torch.float64)
    torch.manual_seed(0)
    kept = 0
    for _ in range(600):
        events = list(engine.generate(prompt, params))
        tokens = [e.token for e in events if e.token is not None]
        counts[0, tokens[1]] += 1
        counts[1, tokens[2]] += 1
        kept += events[-1].stats.tree_alternatives_kept
        assert events[-1].stats.tree_rounds >= 1 and events[-1].stats.k_history[0] == 2  # depth 2 verified first
    assert_second_and_third_follow(counts, exact)
    assert kept > 0


def test_hybrid_trees_equal_plain_with_a_draft_model_and_mtp(tmp_path):
    """A Qwen3.5 target (recurrent layers: a kept alternative's step replayed from the state after its parent): trees
    from a noisy draft model and from the target's own MTP layers, greedy and seeded, equal plain decoding."""
    from tests.test_hybrid import tiny_qwen35, with_mtp
    from quickdraft.speculative.mtp import MtpDrafter

    target = load_model(str(with_mtp(tiny_qwen35(logit_scale=8), tmp_path / "t")), BF16, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_qwen35(logit_scale=8), 0.3), tmp_path / "d")), BF16, False)
    spec = SpeculationConfig(draft_max=4, adaptive=False, tree=3, p_min=0.0)
    kept = 0
    for make in (lambda: DraftModelDrafter(draft, target.config.vocab_size, 256, 0.0),
                 lambda: MtpDrafter(target, 256, 0.0)):
        for params in (SamplingParams(max_tokens=40, stop_at_eos=False),
                       SamplingParams(temperature=0.8, seed=6, max_tokens=40, stop_at_eos=False)):
            plain, _ = run(Engine(target, 256), params)
            ours, final = run(Engine(target, 256, make(), spec), params)
            assert ours == plain and final.stats.tree_rounds > 0
            kept += final.stats.tree_alternatives_kept
    assert kept > 0  # a kept alternative's recurrent step was replayed


def test_a_dflash_drafter_proposes_trees(tmp_path):
    from tests.test_dflash import reference_drafter
    from quickdraft.speculative.draft import Draft, DraftBuilder

    hf = tiny_hf_model("qwen3", layers=6, logit_scale=4)
    tdir = save_hf_dir(hf, tmp_path / "t")
    reference_drafter("dflash2", hf.config).save_pretrained(tmp_path / "d")
    target = load_model(str(tdir), BF16, False)
    spec = SpeculationConfig(draft_max=4, adaptive=False, tree=2, p_min=0.0)
    for params in (SamplingParams(max_tokens=40, stop_at_eos=False),
                   SamplingParams(temperature=0.8, seed=4, max_tokens=40, stop_at_eos=False)):
        plain, _ = run(Engine(target, 256), params)
        drafter = DraftBuilder(target, BF16, 256).drafter(Draft.parse(str(tmp_path / "d")), spec)
        ours, final = run(Engine(target, 256, drafter, spec), params)
        assert ours == plain and final.stats.tree_rounds > 0


def test_trees_stay_off_where_they_are_per_position_of_a_chain(pair):
    """Log-probabilities verify chains (a grammar likewise: _trees)."""
    target, draft = pair
    spec = SpeculationConfig(draft_max=4, adaptive=False, tree=3, p_min=0.0)
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256, 0.0), spec)
    _, final = run(engine, SamplingParams(max_tokens=20, stop_at_eos=False, logprobs=2), PROMPT)
    assert final.stats.tree_rounds == 0 and final.stats.rounds > 0


@pytest.mark.parametrize("name", ["llama3", "qwen3_5"])
def test_a_batched_pass_takes_a_tree_as_its_own_pass_does(tmp_path, name):
    """Transformer.forward_segments with one sequence's rows a tree beside another's chain: each row bit for bit what
    the tree's own pass (forward_tree) and the chain's own pass give, and the kept path's cache (a hybrid's
    recurrent states too) that of the tree's own pass."""
    lm = load_model(str(build(name, tmp_path / name)), BF16, False)
    model = lm.model
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(20)], [(5 * i + 1) % 300 + 3 for i in range(13)]]
    chain = torch.tensor([70, 71, 72])
    with torch.inference_mode():
        caches = [KVCache.for_model(model, 64) for _ in range(4)]  # the batch's two, then each alone
        for cache, prompt in zip(caches, prompts + prompts):
            model(torch.tensor([prompt]), cache)
        start = caches[0].length
        together = lm.forward_segments([torch.tensor(TOKENS), chain], caches[:2], [False, False], [(DEPTHS, 4), None])
        assert torch.equal(together[0], lm.forward_tree(torch.tensor(TOKENS), DEPTHS, 4, caches[2]))
        assert torch.equal(together[1], model(chain[None], caches[3])[0])
        TreeRows.commit(caches[0], start, _path(5))
        TreeRows.commit(caches[2], start, _path(5))
        n = caches[2].length
        assert caches[0].length == n and caches[1].length == caches[3].length
        assert all(torch.equal(a[:, :, :n], b[:, :, :n]) for a, b in zip(caches[0].tensors(), caches[2].tensors()))
        assert all(torch.equal(a, b) for a, b in zip(_recurrent(caches[0], n), _recurrent(caches[2], n)))
        follow = torch.tensor([[7, 8]])
        assert torch.equal(model(follow, caches[0]), model(follow, caches[2]))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_sequences_in_a_batch_verify_trees_and_get_what_they_get_alone(pair, adaptive):
    """Three sequences stepped together, each drafting trees (their alternatives' rows counted in the batch's pass):
    greedy and seeded, each gets its tokens alone; fixed, trees were verified in the batch and candidates kept; the
    adaptive policy verifies a tree in a batch only where one measured faster alone."""
    from quickdraft.engine import Batch

    target, draft = pair
    # adaptive: k between 2 and 4 (draft_min: on these tiny models a batch's policy would otherwise find drafting not
    # worth it, and nothing of the adaptive path would be verified in a batch), a tree where it measures faster
    spec = SpeculationConfig(draft_max=4, draft_min=2 if adaptive else 0, adaptive=adaptive, tree=3, p_min=0.0)
    engine = Engine(target, 256, DraftModelDrafter(draft, target.config.vocab_size, 256, 0.0), spec, slots=4)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[3:] + PROMPT[:3]]
    trees = kept = rounds = 0  # on steps that ran several sequences: in a batched pass
    for params in (SamplingParams(max_tokens=32, stop_at_eos=False),
                   SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, stop_at_eos=False)):
        batch = Batch(engine, 3)
        sequences = [batch.add(p, params) for p in prompts]
        tokens = {id(s): [] for s in sequences}
        while batch.active:
            stepped = [(s, s.stats.tree_rounds, s.stats.tree_alternatives_kept, s.stats.rounds) for s in batch.active]
            batch.step(lambda s, item: tokens[id(s)].append(getattr(item, "token", None)))
            if len(stepped) > 1:
                trees += sum(s.stats.tree_rounds - t for s, t, _, _ in stepped)
                kept += sum(s.stats.tree_alternatives_kept - k for s, _, k, _ in stepped)
                rounds += sum(s.stats.rounds - r for s, _, _, r in stepped)
        alone = [run(Engine(target, 256), params, p)[0] for p in prompts]
        assert [[t for t in tokens[id(s)] if t is not None] for s in sequences] == alone
    assert rounds > 0  # drafts were verified in batched passes
    assert adaptive or (trees > 0 and kept > 0)  # fixed: trees among them (adaptive: only where one measured faster)


def test_a_tree_near_the_end_of_the_context_fits_it(pair):
    """The alternatives' rows are bounded by the room the cache has left: generating up to the context's end with
    trees of 3 gives plain decoding's tokens."""
    target, draft = pair
    context = len(PROMPT) + 12
    spec = SpeculationConfig(draft_max=4, adaptive=False, tree=3, p_min=0.0)
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    plain, _ = run(Engine(target, context), params)
    ours, final = run(Engine(target, context, DraftModelDrafter(draft, target.config.vocab_size, context, 0.0), spec),
                      params)
    assert ours == plain and final.stats.tree_rounds > 0
