"""`quickdraft tune`: the speed model, the reasons it gives, and the profile generate takes."""

import json

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.config import SamplingParams, SpeculationConfig
from quickdraft.engine import Engine
from quickdraft.speculative.base import Offer
from quickdraft.tools.tune import SWITCH, Candidate, Costs, explain, read_profile, reference, simulate
from quickdraft.speculative.draft_model import DraftModelDrafter
from tests.helpers import PROMPT, cli, drafter, tiny_hf_model, write_gguf_from_hf


@pytest.fixture
def models(bf16_pair):
    return bf16_pair


def test_the_replay_costs_rounds_as_the_engine_runs_them():
    costs = Costs(t_plain=1.0, v={1: 1.1, 2: 1.2, 3: 1.3}, overhead=0.0, t_draft=0.1)
    sure = [Offer("", 0, 0)] + [Offer("draft", 3, 7 - t) for t in range(1, 8)]  # 8 tokens, every draft kept
    rule = DraftModelDrafter.replay_round  # a draft model's passes: what these offers' source costs
    sim = simulate(sure, 3, costs, rule)
    # t=1: 3 kept + 1 (1.3 + 3 * 0.1); t=5: 2 drafted, all the budget allows (1.2 + 0.2)
    assert (sim["rounds"], sim["plain"], sim["tried"], sim["kept"]) == (2, 0, [2, 2, 1], [2, 2, 1])
    assert sim["speedup"] == pytest.approx(7 / (1.6 + 1.4))
    assert simulate(sure[:6], 3, costs, rule)["plain"] == 1  # t=5 is the last token: a plain step
    never = [Offer("", 0, 0)] + [Offer("draft", 3, 0)] * 8
    assert simulate(never, 2, costs, rule)["speedup"] == pytest.approx(8 / (6 * 1.4 + 1.2 + 1.0))
    # n-gram rounds cost no draft passes, but the draft model catches up after them
    mixed = [Offer("", 0, 0), Offer("ngram", 4, 4)] + [Offer("draft", 3, 0)] * 7
    assert simulate(mixed, 3, costs, rule)["seconds"] == pytest.approx(1.3 + (1.3 + 4 * 0.1) + 1.4 + 1.2 + 1.0)
    # a draft unsure of its second token stops after one: two passes for one drafted token
    unsure = [Offer("", 0, 0)] + [Offer("draft", 1, 1)] * 5
    assert simulate(unsure, 3, costs, rule)["seconds"] == pytest.approx(2 * (1.1 + 2 * 0.1) + 1.0)


@pytest.mark.parametrize("kind,p_min", [("draft", 0.0), ("draft", 0.7), ("ngram", 0.0), ("combined", 0.7)])
def test_the_replay_matches_the_engine(models, kind, p_min):
    """Greedy rounds replayed over the plain output are the rounds the engine runs, position by position."""
    target, draft = models
    k = 3
    outputs, _ = reference(target, {"p": PROMPT}, 40)
    engine = Engine(target, 256, drafter(kind, target, draft, p_min), SpeculationConfig(draft_max=k, adaptive=False))
    events = list(engine.generate(PROMPT, SamplingParams(max_tokens=40, stop_at_eos=False)))
    stats = events[-1].stats
    replayed = drafter(kind, target, draft, p_min)
    sim = simulate(replayed.offers(PROMPT, outputs["p"], k), k, Costs(1.0, {i: 1.0 for i in range(1, k + 1)}, 0.0, 0.0),
                   replayed.replay_round)
    assert stats.rounds > 3 and stats.draft_n_accepted > 0
    assert kind == "ngram" or stats.draft_n_accepted < stats.draft_n  # rejections are replayed too
    assert (sim["rounds"], sim["plain"]) == (stats.rounds, stats.plain_steps)
    assert (sim["tried"], sim["kept"]) == (pad(stats.position_tried, k), pad(stats.position_accepted, k))
    if kind == "draft" and p_min:  # unsure, the draft stopped after 1 token in some rounds, after 2 in others
        assert {1, 2} <= set(stats.k_history)


@pytest.mark.parametrize("kind,p_min", [("draft", 0.0), ("draft", 0.15), ("combined", 0.0)])
def test_the_tree_replay_matches_the_engine(models, kind, p_min):
    """Trees replayed over the plain output (--draft-tree 3) are the rounds the engine runs: where each tree puts its
    candidates (the chain's least sure position, judged past its first wrong guess too), which rounds keep one, and
    where the draft stops early."""
    target, draft = models
    k, n = 4, 64
    outputs, _ = reference(target, {"p": PROMPT}, n)
    engine = Engine(target, 256, drafter(kind, target, draft, p_min),
                    SpeculationConfig(draft_max=k, adaptive=False, tree=3))
    events = list(engine.generate(PROMPT, SamplingParams(max_tokens=n, stop_at_eos=False)))
    assert [e.token for e in events if e.token is not None] == outputs["p"]
    stats = events[-1].stats
    replayed = drafter(kind, target, draft, p_min)
    costs = Costs(1.0, {i: 1.0 for i in range(1, k + 1)}, 0.0, 0.0, {3: {i: 1.0 for i in range(1, k + 1)}})
    sim = simulate(replayed.offers(PROMPT, outputs["p"], k), k, costs, replayed.replay_round, width=3)
    assert stats.tree_rounds >= 3 and stats.tree_alternatives_kept > 0  # the case the replay must get right
    assert (sim["rounds"], sim["plain"], sim["trees"], sim["alternatives"]) == \
        (stats.rounds, stats.plain_steps, stats.tree_rounds, stats.tree_alternatives_kept)
    # (the engine counts a kept candidate as its depth's acceptance; tune's acceptance is the chain's)
    assert sim["tried"] == pad(stats.position_tried, k)
    assert sum(sim["kept"]) + sim["alternatives"] == sum(stats.position_accepted)
    chain = simulate(replayed.offers(PROMPT, outputs["p"], k), k, costs, replayed.replay_round)
    assert chain["trees"] == chain["alternatives"] == 0
    if p_min:  # unsure, the draft stopped early in some rounds (the replay said where, past wrong guesses too)
        assert min(stats.k_history) < k


def pad(counts: list[int], k: int) -> list[int]:
    return counts + [0] * (k - len(counts))


def test_losers_are_explained():
    v = {1: 1.1, 2: 2.0}
    winner = Candidate("small", 0.05, [0.9, 0.8], best_k=2, best_speedup=2.0)
    slow = Candidate("big", 0.6, [0.95, 0.9], best_k=1, best_speedup=0.9)
    assert "too slow a draft" in explain(slow, v, winner)
    weak = Candidate("other", 0.05, [0.3, 0.2], coverage=0.3, best_k=2, best_speedup=0.8)
    assert "too low an acceptance" in explain(weak, v, winner) and "verification too costly" in explain(weak, v, winner)
    assert "too few proposals" in explain(weak, v, winner)
    rare = Candidate("ngram", 0.0, [0.9, 0.9], coverage=0.4, best_k=2, best_speedup=1.3)
    assert "fewer steps" in explain(rare, v, winner)
    close = Candidate("close", 0.05, [0.7, 0.6], best_k=2, best_speedup=1.6)
    assert "lower acceptance" in explain(close, v, winner)
    tree = Candidate("small", 0.05, [0.9, 0.8], best_k=2, best_speedup=1.8, tree=3, alternatives=0.07)
    assert "its tree kept an alternative in 7% of rounds" in explain(tree, v, winner)  # against its own chain
    assert "the same drafter as a tree of 3" in explain(winner, v, tree)
    slow_tree = Candidate("small", 0.05, [0.9, 0.8], best_k=2, best_speedup=0.9, tree=2, alternatives=0.02)
    assert "not enough for the candidates' rows" in explain(slow_tree, v, winner)


def test_bad_profiles_say_what_to_do(tmp_path):
    with pytest.raises(QuickdraftError, match="no such profile"):
        read_profile(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(QuickdraftError, match="not JSON"):
        read_profile(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text('{"version": 0}')
    with pytest.raises(QuickdraftError, match="run tune again"):
        read_profile(tmp_path / "old.json")


def test_tune_writes_a_profile_that_generate_takes(tmp_path):
    path = write_gguf_from_hf(tiny_hf_model("llama", seed=8, logit_scale=6), tmp_path / "t.gguf")
    profile = tmp_path / "p.json"
    r = cli("tune", "-m", str(path), "--draft", str(path), "--draft", "ngram", "--kmax", "4", "-n", "12",
            "--prompts", "qa-en,code-en", "--dtype", "bfloat16", "--profile", str(profile), "--draft-vocab", "64",
            "--draft-weights", "bf16")  # (the tiny model's int4 head is in PyTorch's packing, which cannot be cut)
    assert r.returncode == 0, r.stderr
    assert "recommendation:" in r.stdout and "v(k)" in r.stdout
    p = json.loads(profile.read_text())
    assert set(p) >= {"version", "target", "draft", "draft_max", "predicted_speedup", "measured_speedup",
                      "v", "candidates", "checked"}
    # the draft model measured with its whole head and with it cut to 64 of its 320 ids, each as a chain and as trees
    # of 2 and 3 candidates (tune's --draft-tree 3), from the same replay and the target's measured tree passes
    assert [(c["name"], c["vocab"], c["tree"]) for c in p["candidates"]] == \
        [(str(path), 0, 1), (str(path), 0, 2), (str(path), 0, 3), (str(path), 64, 1), (str(path), 64, 2),
         (str(path), 64, 3), ("ngram", 0, 1)]
    assert "vocab=64" in r.stdout and "tree=3" in r.stdout and set(p["v_tree"]) == {"2", "3"}
    assert all(len(c["acceptance"]) == 4 and c["best_k"] in range(1, 5) for c in p["candidates"])
    # every candidate but the winner (the best one when nothing beats plain decoding) says why it lost
    assert sum(not c["why_not"] for c in p["candidates"]) == 1 and p["candidates"][0]["r"] > 0
    # the choice follows from the profile's own figures by tune's rule (which way it goes is the machine's): the
    # best prediction above 1, none when nothing beats plain decoding; the predictions within 15% of it checked in
    # a short run, and one measured more than SWITCH times faster than the pick taking its place
    ranked = sorted((c for c in p["candidates"] if c["best_speedup"] > 1), key=lambda c: -c["best_speedup"])
    if not ranked:
        assert (p["draft"], p["draft_vocab"], p["checked"]) == ("none", 0, [])
    else:
        top = [c for c in ranked if c["best_speedup"] >= 0.85 * ranked[0]["best_speedup"]][:3]
        assert [(x["candidate"], x["vocab"], x["tree"], x["predicted"]) for x in p["checked"]] == \
            [(c["name"], c["vocab"], c["tree"], c["best_speedup"]) for c in top]
        pick, fastest = p["checked"][0], max(p["checked"], key=lambda x: x["measured"])
        pick = fastest if fastest["measured"] > SWITCH * pick["measured"] else pick
        assert (p["draft"], p["draft_vocab"], p["draft_tree"], p["measured_speedup"]) == \
            (pick["candidate"], pick["vocab"], pick["tree"], pick["measured"])
        assert f"recommendation: {p['draft']}" in r.stdout
    g = cli("generate", "-m", str(path), "-p", "hello", "-n", "6", "--profile", str(profile), "--json",
            "--ignore-eos", "--dtype", "bfloat16")
    assert g.returncode == 0, g.stderr
    spec = json.loads(g.stdout)["spec"]
    if p["draft"] == "none":
        assert spec is None
    else:
        assert spec["drafter"] == p["draft"] and max(spec["k_history"]) <= p["draft_max"]
        assert (spec["tree_rounds"] > 0) == (p["draft_tree"] > 1)  # the profile's tree, or chains


def test_tune_recommends_the_fastest_format_within_the_quality_bound(tmp_path):
    path = write_gguf_from_hf(tiny_hf_model("llama", seed=8, logit_scale=6), tmp_path / "t.gguf")
    profile = tmp_path / "p.json"
    args = ("tune", "-m", str(path), "--draft", "ngram", "--kmax", "3", "-n", "12", "--prompts", "code-en",
            "--dtype", "bfloat16", "--profile", str(profile), "--formats", "int8,bf16")
    r = cli(*args, "--quality-bound", "0")
    assert r.returncode == 0, r.stderr
    p = json.loads(profile.read_text())
    rows = {row["weights"]: row for row in p["formats"]}
    assert list(rows) == ["int8", "bf16"] and p["quality_bound"] == 0
    assert rows["bf16"]["kl"] == 0 and rows["bf16"]["top1"] == 1 and rows["bf16"]["ppl_increase"] == 0
    assert rows["int8"]["kl"] > 0 and rows["int8"]["tokens"] >= 256  # int8 moved the distributions
    assert rows["bf16"]["within_bound"] and rows["int8"]["within_bound"] == (rows["int8"]["ppl_increase"] <= 0)
    within = [w for w, row in rows.items() if row["within_bound"]]
    assert p["weights"] == max(within, key=lambda w: rows[w]["tok_s"])
    assert all(isinstance(row["tok_s"], float) and isinstance(row["plain_tok_s"], float) for row in rows.values())
    assert "target formats" in r.stdout and f"weights: {p['weights']}" in r.stdout and "KL" in r.stdout
    # generate and serve take the profile's format unless --weights says otherwise
    from argparse import Namespace
    from quickdraft.cli.commands import apply_profile

    for given, taken in (("auto", p["weights"]), ("int4", "int4")):
        a = Namespace(profile=profile, model=str(path), weights=given, draft="auto", ngram=False, draft_max=16,
                      fixed_k=False, draft_p_min=0.5, draft_min=0)
        apply_profile(a)
        assert a.weights == taken and a.draft == p["draft"]
    # a bound without formats to choose from is a mistake, said as one
    r = cli("tune", "-m", str(path), "--quality-bound", "2", "--profile", str(profile))
    assert r.returncode != 0 and "--formats" in r.stderr
    r = cli(*args[:-1], "int3")
    assert r.returncode != 0 and "--formats 'int3'" in r.stderr
