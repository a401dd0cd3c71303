"""The adaptive policy picks k from measured costs and acceptance, plain decoding included."""

import pytest

from quickdraft.config import SpeculationConfig
from quickdraft.speculative.policy import AdaptivePolicy


def trained(acceptance: float, verify_slope: float, draft_cost: float, rounds: int = 60, k: int = 6):
    """A policy fed rounds whose drafts are accepted independently with probability `acceptance`
    (fractional counts), with t_plain = 1, t_verify(k) = 1 + slope * k and draft_cost per draft."""
    policy = AdaptivePolicy(SpeculationConfig(draft_max=12))
    for _ in range(2):  # the first timing of each kind is a warm-up and is dropped
        policy.record_plain(1.0)
        for kk in (1, k):
            policy.record_round("draft", kk, 0, draft_cost * kk, 1 + verify_slope * kk)
    tried = policy.tried.setdefault("draft", [0.0] * k)
    acc = policy.accepted.setdefault("draft", [0.0] * k)
    for i in range(k):
        tried[i], acc[i] = rounds, rounds * acceptance
    return policy


def test_speculates_when_it_pays():
    policy = trained(acceptance=0.9, verify_slope=0.02, draft_cost=0.05)
    k = policy.k_for("draft")
    assert k >= 4
    assert policy.predicted_rate("draft", k) > 2 * policy.predicted_rate("draft", 0)


def test_plain_decoding_when_verification_is_costly():
    policy = trained(acceptance=0.5, verify_slope=0.6, draft_cost=0.4)
    assert policy.k_for("draft") == 0


def test_probes_after_a_run_of_plain_steps_as_long_as_its_expected_loss_allows():
    """A probe is a round expected to lose: it waits probe_every plain steps, and more where its loss (drafts and
    verification against the plain steps its tokens would take) would cost more than PROBE_SHARE of them."""
    from quickdraft.speculative.policy import PROBE_SHARE

    cheap = trained(acceptance=0.1, verify_slope=0.15, draft_cost=0.05)  # a probe costs a fraction of a step
    dear = trained(acceptance=0.5, verify_slope=0.6, draft_cost=0.4)  # 2 drafts: 2.2 steps for 1.75 tokens
    assert cheap._probe_wait("draft", 0) < cheap.cfg.probe_every
    assert dear._probe_wait("draft", 0) == int((0.8 + 2.2 - 1.75) / PROBE_SHARE)
    for policy in (cheap, dear):
        wait = max(policy.cfg.probe_every, policy._probe_wait("draft", 0))
        for _ in range(wait):
            assert policy.k_for("draft") == 0
            policy.record_plain(1.0)
        assert policy.k_for("draft") > 0


def test_first_plain_step_then_probe_of_an_unseen_source():
    policy = AdaptivePolicy(SpeculationConfig())
    assert policy.k_for("ngram") == 0  # nothing measured yet: plain steps first
    policy.record_plain(0.5)  # a warm-up: dropped
    assert policy.k_for("ngram") == 0
    policy.record_plain(0.2)
    assert policy.t_plain == 0.2 and policy.k_for("ngram") == 4


def test_fixed_and_bounded_k():
    assert AdaptivePolicy(SpeculationConfig(draft_max=5, adaptive=False)).k_for("draft") == 5
    policy = trained(acceptance=0.5, verify_slope=0.6, draft_cost=0.4)
    policy.cfg = SpeculationConfig(draft_min=2, draft_max=12)
    assert policy.k_for("draft") >= 2  # draft_min > 0 forbids plain steps


def test_verify_cost_interpolates_between_measurements():
    policy = AdaptivePolicy(SpeculationConfig())
    for _ in range(2):
        policy.record_plain(1.0)
        policy.record_round("draft", 4, 2, 0.1, 1.4)
    assert policy.verify_seconds(2) == pytest.approx(1.2)
    assert policy.verify_seconds(8) == pytest.approx(1.8)  # extrapolated with the measured slope


def test_probes_back_off_while_plain_keeps_winning_and_are_short():
    """Each probe that finds plain decoding still better doubles the wait for the next (a probe is a round expected
    to lose), up to PROBE_MAX; a probe drafts at most PROBE_SHORT tokens; once speculation wins the wait resets."""
    from quickdraft.speculative.policy import PROBE_MAX, PROBE_SHORT

    policy = trained(acceptance=0.1, verify_slope=0.15, draft_cost=0.05)  # a probe's loss allows one in 16 steps
    waits, since = [], 0
    for _ in range(2000):
        k = policy.k_for("draft")
        if k:
            assert k <= PROBE_SHORT
            waits.append(since)
            since = 0
            policy.record_round("draft", k, 0, 0.05 * k, 1 + 0.15 * k)  # rejected: plain still wins
        else:
            since += 1
            policy.record_plain(1.0)
    assert waits[:5] == [16, 32, 64, 128, 256] and set(waits[5:]) == {PROBE_MAX}
    policy.begin()  # a new generation: its text may draft better; probing starts over
    assert policy.since["draft"] >= 16 and policy.k_for("draft") > 0
    for i in range(len(policy.tried["draft"])):  # drafts now always accepted: speculation wins
        policy.tried["draft"][i], policy.accepted["draft"][i] = 200, 200
    policy.t_draft["draft"] = 0.01
    policy.t_verify = {k: 1.0 + 0.01 * k for k in range(1, 13)}
    assert policy.k_for("draft") > PROBE_SHORT and "draft" not in policy.probe_after



def test_a_long_run_of_rounds_times_a_plain_step_again():
    """t_plain is measured on plain steps alone: while speculation keeps winning, one plain step every REFRESH
    rounds keeps it current (a stale one could hold the policy speculating where plain decoding got faster)."""
    from quickdraft.speculative.policy import REFRESH

    policy = trained(acceptance=0.9, verify_slope=0.02, draft_cost=0.05)
    policy.record_plain(1.0)
    for _ in range(REFRESH):
        k = policy.k_for("draft")
        assert k > 0
        policy.record_round("draft", k, k, 0.05 * k, 1 + 0.02 * k)
    assert policy.k_for("draft") == 0  # the refresh
    policy.record_plain(2.0)  # one slow sample is taken for an outlier
    assert policy.t_plain == 1.0
    policy.record_plain(2.0)  # the machine got slower: the new timings count
    assert policy.t_plain == 2.0 and policy.k_for("draft") > 0
    policy.cfg = SpeculationConfig(draft_min=1, draft_max=12)
    for _ in range(REFRESH):
        policy.record_round("draft", 4, 4, 0.2, 1.08)
    assert policy.k_for("draft") >= 1  # draft_min > 0 forbids plain steps, refreshes too


def test_a_timing_is_robust_to_one_slow_sample_and_follows_a_lasting_change():
    """On a shared machine a step now and then takes several times as long: the median of the last few samples
    ignores it, where an average would carry it for many rounds; a lasting change is followed within a few."""
    from quickdraft.speculative.policy import WINDOW

    policy = trained(acceptance=0.9, verify_slope=0.02, draft_cost=0.05)
    for _ in range(WINDOW):
        policy.record_round("draft", 4, 4, 0.2, 1.08)
    policy.record_round("draft", 4, 4, 0.2, 5.0)  # preempted
    assert policy.t_verify[4] == pytest.approx(1.08)
    for _ in range(WINDOW // 2 + 1):
        policy.record_round("draft", 4, 4, 0.4, 2.16)  # twice as slow from now on
    assert policy.t_verify[4] == pytest.approx(2.16) and policy.t_draft["draft"] == pytest.approx(0.1)


def test_a_verification_counts_against_the_plain_steps_of_its_moment():
    """The machine's speed drifts (here a spell 40% slower); a verification is worth what it costs against plain
    steps timed beside it. Counted in seconds against plain steps of another moment, verifications timed in the fast
    spell made one checked draft look cheaper than a plain step in the slow one (v(1) of 0.93 where it is 1.3), and
    lookup at 25% acceptance, which loses, looked 1.3x faster."""
    policy = AdaptivePolicy(SpeculationConfig(draft_max=4))
    for speed in (1.0,) * 5 + (1.4,) * 2:  # plain steps, then a probe, at the machine's speed of the moment
        for _ in range(3):
            policy.record_plain(speed)
        policy.record_round("ngram", 1, 0, 0.0, 1.3 * speed)
    policy.tried["ngram"], policy.accepted["ngram"] = [40.0], [10.0]
    assert policy.t_plain == 1.4 and policy.snapshot()["v"][1] == pytest.approx(1.3)
    assert policy.predicted_rate("ngram", 1) < policy.predicted_rate("ngram", 0)
    assert policy.k_for("ngram") == 0


def test_a_catch_up_is_a_cost_per_round_and_a_switch_back_is_not_counted():
    """A draft model pays one pass over the tokens n-gram rounds added before it drafts again: a cost per round,
    whatever its k (so it favours longer rounds), that can make plain decoding the faster choice; the catch-up
    of the round that resumes speculation after plain steps is the cost of switching, not of a round."""
    from quickdraft.speculative import speed
    from quickdraft.speculative.policy import CATCH_UP_EMA

    policy = trained(acceptance=0.7, verify_slope=0.05, draft_cost=0.1)
    k_free = policy.k_for("draft")
    assert k_free > 0 and policy.t_catch_up["draft"] == 0.0
    policy.t_catch_up["draft"] = 0.6
    k = policy.k_for("draft")
    assert k >= k_free
    assert policy.predicted_rate("draft", k) == pytest.approx(
        speed.expected_length(policy.acceptance("draft", k)) / (policy.verify_seconds(k) + 0.1 * k + 0.6))
    policy.t_catch_up["draft"] = 3.0  # catching up costs more than speculation wins
    assert policy.k_for("draft") == 0 and "draft" in policy.resuming
    policy.record_round("draft", 2, 2, 0.2, 1.1, catch_up_s=9.0)  # the probe's catch-up over the plain steps
    w = CATCH_UP_EMA
    assert policy.t_catch_up["draft"] == pytest.approx((1 - w) * 3.0) and "draft" not in policy.resuming  # as none
    policy.record_round("draft", 2, 2, 0.2, 1.1, catch_up_s=1.0)  # a round after n-gram rounds
    assert policy.t_catch_up["draft"] == pytest.approx((1 - w) ** 2 * 3.0 + w * 1.0)
    policy.begin()  # another text: how often lookup interleaves is its own
    assert policy.t_catch_up == {}


def test_where_speculation_wins_narrowly_plain_steps_are_timed_more_often():
    """Near the break-even point the choice rests on t_plain and a plain step costs least there: one every
    REFRESH_NEAR rounds instead of every REFRESH."""
    from quickdraft.speculative.policy import MARGIN, REFRESH_NEAR

    policy = trained(acceptance=0.5, verify_slope=0.1, draft_cost=0.25)
    k = policy.k_for("draft")
    gain = policy.predicted_rate("draft", k) / policy.predicted_rate("draft", 0)
    assert k > 0 and 1.0 < gain < MARGIN
    policy.record_plain(1.0)
    steps = []
    for _ in range(REFRESH_NEAR + 1):
        steps.append(policy.k_for("draft"))
        if steps[-1]:
            policy.rounds_since_plain += 1  # a round whose counts leave the estimate as it is
    assert steps[:REFRESH_NEAR] == [k] * REFRESH_NEAR and steps[-1] == 0


def test_a_probe_that_wins_keeps_the_next_one_close():
    """A probe whose drafts beat plain steps (an estimate turned speculation off where it pays) is followed by the
    next after probe_every plain steps again; one that loses doubles the wait (probes cheap enough that their loss
    allows one every probe_every steps)."""
    policy = trained(acceptance=0.1, verify_slope=0.15, draft_cost=0.05)

    def wait_for_probe() -> int:
        steps = 0
        while policy.k_for("draft") == 0:
            policy.record_plain(1.0)
            steps += 1
        return steps

    every = policy.cfg.probe_every
    assert wait_for_probe() == every
    policy.record_round("draft", 2, 0, 0.1, 1.3)  # lost: 1 token in 1.4 seconds
    assert wait_for_probe() == 2 * every
    policy.record_round("draft", 2, 2, 0.1, 1.1)  # won: 3 tokens in 1.2 seconds
    assert wait_for_probe() == every


# ---- batched steps (engine.Batch): the k of each sequence chosen for the step as a whole -------------------------

def batch_policy(acceptance: float, pass_cost, rows=(4, 8, 16, 32), draft_cost: float = 0.0):
    """A policy that measured batched passes of these rows at pass_cost(rows) seconds, and n-gram drafts accepted
    with probability `acceptance`."""
    from quickdraft.speculative.policy import BatchPlan  # noqa: F401 (the plan these tests drive)

    policy = trained(acceptance, verify_slope=0.1, draft_cost=draft_cost)
    policy.t_draft["ngram"] = draft_cost
    policy.tried["ngram"], policy.accepted["ngram"] = [60.0] * 8, [60.0 * acceptance] * 8
    for r in rows:
        for _ in range(2):
            policy.record_pass(r, pass_cost(r))
    return policy


def plan_ks(policy, sequences: int, cfg=SpeculationConfig(draft_max=8), budget=8):
    from quickdraft.speculative.policy import BatchPlan

    plan = BatchPlan(policy, sequences, sequences, 64)
    return [plan.k_for(i, cfg, budget)("ngram") for i in range(sequences)]


def test_pass_costs_are_interpolated_and_extrapolated_from_what_was_measured():
    policy = batch_policy(0.5, lambda r: 1.0 + 0.05 * r, rows=(4, 8))
    assert policy.pass_seconds(4) == pytest.approx(1.2)
    assert policy.pass_seconds(6) == pytest.approx(1.3)
    assert policy.pass_seconds(20) == pytest.approx(2.0)  # the slope of the last two points
    assert AdaptivePolicy(SpeculationConfig()).pass_seconds(4) is None


def test_a_batch_drafts_where_rows_are_nearly_free_and_not_where_they_are_not():
    flat = batch_policy(0.8, lambda r: 1.0 + 0.01 * r)  # memory-bound: a row costs 1% of a pass
    assert all(k >= 4 for k in plan_ks(flat, 4))
    saturated = batch_policy(0.8, lambda r: 0.3 * r)  # compute-bound: a pass costs as its rows
    assert plan_ks(saturated, 4) == [0, 0, 0, 0]


def test_a_batch_spends_its_rows_where_drafts_are_accepted_and_within_its_rows():
    policy = batch_policy(0.1, lambda r: 1.0 + 0.04 * r)  # drafts rarely kept: not worth a row
    assert plan_ks(policy, 4) == [0, 0, 0, 0]
    cheap = batch_policy(0.9, lambda r: 1.0 + 0.001 * r)
    ks = plan_ks(cheap, 8, budget=16, cfg=SpeculationConfig(draft_max=16))
    assert sum(ks) + 8 <= 64 and max(ks) > 0


def test_fixed_k_is_kept_in_a_batch_and_an_untimed_source_waits():
    policy = batch_policy(0.5, lambda r: 0.3 * r)
    assert plan_ks(policy, 3, cfg=SpeculationConfig(draft_max=4, adaptive=False)) == [4, 4, 4]
    from quickdraft.speculative.policy import BatchPlan

    plan = BatchPlan(policy, 2, 2, 64)
    assert plan.k_for(0, SpeculationConfig(draft_max=4), 4, lag=lambda source: 30)("never-timed") == 0


def test_a_tree_in_a_batch_takes_the_rows_left_and_pays_for_them():
    """A sequence's candidates in a batched step: at most the rows its pass has left; fixed (--fixed-k), as many as
    asked; adaptive, only where the candidates' measured kept share buys more tokens per second than their rows cost
    the whole batch's pass, and not before a tree was measured."""
    from quickdraft.speculative.policy import BatchPlan

    adaptive, fixed = SpeculationConfig(draft_max=4, tree=3), SpeculationConfig(draft_max=4, tree=3, adaptive=False)
    flat = batch_policy(0.8, lambda r: 1.0 + 0.01 * r)  # a row costs 1% of a pass
    plan = BatchPlan(flat, 2, 2, 8)
    assert plan.k_for(0, fixed, 4)("ngram") == 4 and plan.branches("ngram", 3, fixed) == 3
    assert plan.branches("ngram", 8, fixed) == 3  # 8 rows: 2 pending tokens, 4 drafts, 2 left
    assert plan.branches("ngram", 3, adaptive) == 1  # no tree measured yet
    flat.tree_gain["ngram"] = 0.3
    assert plan.branches("ngram", 3, adaptive) == 3
    saturated = batch_policy(0.8, lambda r: 0.3 * r)  # a pass costs as its rows: candidates do not pay
    saturated.tree_gain["ngram"] = 0.3
    plan = BatchPlan(saturated, 2, 2, 64)
    assert plan.k_for(0, fixed, 4)("ngram") == 4 and plan.branches("ngram", 3, adaptive) == 1


def test_a_drafter_is_started_only_where_its_catch_up_pays_back():
    """A draft model that must first take in its window of a long prompt: started where what it saves over the tokens
    still to come (counted at 1 / START_MARGIN) pays for that at its measured cost per token; else not (another source,
    n-gram lookup, may draft meanwhile), in a sequence alone and in a batch alike."""
    from quickdraft.speculative import policy as policies

    policy = trained(acceptance=0.8, verify_slope=0.05, draft_cost=0.1)  # speculation pays: t_plain 1
    for seconds in (0.05, 0.02, 0.02):  # a catch-up costs 0.02 of a plain step per token (the first is a warm-up)
        assert policy.record_catch_up("draft", 100, 100 * seconds) == 0.0  # a start: not a round's own cost
    assert policy.record_catch_up("draft", 3, 0.06) == 0.06  # after n-gram rounds: the round's cost
    assert policy.t_feed["draft"] == 0.02
    k = policy.k_for("draft")
    saving = 1 - 1 / policy.predicted_rate("draft", k)  # of a plain step, per token
    lag = 1000  # costs 20 plain steps
    short, long = int(policies.START_MARGIN * 20 / saving) - 5, int(policies.START_MARGIN * 20 / saving) + 5
    assert policy.k_for("draft", lag=lag, horizon=short) == 0
    assert policy.k_for("draft", lag=lag, horizon=long) == k
    assert policy.k_for("draft", lag=2, horizon=1) == k  # a round's own catch-up: no start to weigh
    for rows in (2, 2, 8, 8):  # batched passes: 2 rows cost 1.05 plain steps, 8 rows 1.3
        policy.record_pass(rows, 1.05 if rows == 2 else 1.3)
    for horizon, started in ((short, False), (long, True), (None, True)):
        plan = policies.BatchPlan(policy, 1, 1, 64)  # (a sequence of a batch, stepped alone this time)
        assert (plan.k_for(0, policy.cfg, 16, lag=lambda source: lag, horizon=horizon)("draft") > 0) == started


def test_a_verification_timed_on_a_short_prompt_is_moved_to_a_long_ones_length():
    """A row's attention grows with the positions it reads: plain steps at two lengths far apart give what a position
    costs a row, and a verification of k + 1 rows timed on a short prompt is counted at the long one as k + 1 rows
    reading the longer context, at the attention kernel's price of rows (it reads the positions once for all of them:
    attention_rows). The draft that paid on the short prompt (40% accepted; t_plain 1, k = 4 verified in 1.2) is
    predicted to lose at 10,000 positions, where a plain step costs 3 (each row's reading 2 more), and is not started
    there."""
    from quickdraft.speculative.policy import attention_rows

    policy = trained(acceptance=0.4, verify_slope=0.05, draft_cost=0.05)
    policy.position = 100
    for _ in range(6):
        policy.record_plain(1.0)
    assert policy.k_for("draft") > 0 and policy.per_position() == 0.0  # only short prompts seen: nothing to move
    short_verify = policy.verify_seconds(4)
    policy.position = 10_100
    for _ in range(6):
        policy.record_plain(3.0)  # a plain step there: its one row reads 10,000 more positions
    assert policy.per_position() == pytest.approx(2.0 / 10_000, rel=0.02)
    assert policy.plain_seconds() == pytest.approx(3.0, rel=0.02)
    assert policy.verify_seconds(4) == pytest.approx(short_verify + attention_rows(5) * 2.0, rel=0.02)
    assert attention_rows(5) < 5
    assert all(policy.predicted_rate("draft", k) < policy.predicted_rate("draft", 0) for k in range(1, 7))
    assert policy.k_for("draft", lag=1000, horizon=128) == 0  # its catch-up is not started
    policy.position = 0  # back to where the verifications were timed: their timings stand (as shares of a plain step
    assert policy.verify_seconds(4) == pytest.approx(short_verify, rel=0.03)  # there, which the slope puts 2% lower)


def test_a_probe_that_would_start_a_drafter_on_a_long_prompt_is_weighed_as_a_start():
    """Where plain decoding wins, a probe drafts a few tokens now and then to measure acceptance again; one whose
    drafter must first take in its window of a long prompt (here 20 plain steps' worth) is not taken, one whose
    drafter has little to take in (a short prompt: 2 plain steps' worth, or a few tokens) is."""
    def losing():
        policy = trained(acceptance=0.2, verify_slope=0.3, draft_cost=0.3)
        for _ in range(3):
            policy.record_catch_up("draft", 100, 100 * 0.02)
        for _ in range(160):  # plain steps: a probe whose catch-up is a few steps is due
            policy.record_plain(1.0)
        return policy

    assert losing().k_for("draft", lag=3, horizon=128) > 0  # a probe
    assert losing().k_for("draft", lag=100, horizon=128) > 0  # its catch-up costs 2 plain steps: still a probe
    assert losing().k_for("draft", lag=1000, horizon=128) == 0  # 20 plain steps: not a probe's cost


# ---- the machine's prices (Prior): what a cold process decides from ---------------------------------------------

def cold(per_row: float, draft_share: float):
    """A policy that has timed two plain steps (t_plain 48 ms, 33 of them the target's weights) and nothing else, with
    this machine's prices: each verified row costs per_row of a row's weights; the draft model's weights cost
    draft_share of the target's (24 layers to the target's 28); lookup is free."""
    from quickdraft.speculative.policy import Prior

    def weights(scale):
        return lambda rows: scale * 0.033 * (1 + per_row * (rows - 1))

    policy = AdaptivePolicy(SpeculationConfig(), Prior(weights(1.0), 28, {"draft": (weights(draft_share), 24)},
                                                       frozenset({"ngram"})))
    for _ in range(2):
        policy.record_plain(0.048)
    return policy


def test_a_cold_process_prices_verification_and_drafts_by_the_machines_calibration():
    """Before any round is timed: a verification costs what the calibration says its rows cost (AVX2 int4: 2.7 plain
    steps for 5 rows, as measured on a Zen 3; VNNI: 1.9), the draft model a step of its own weights and its share of
    the rest, lookup nothing. On the AVX2 machine a draft model is not started on a long prompt, nor probed while a
    probe's window would cost seconds; on the VNNI one, where its drafts are known to be accepted, it is."""
    avx2, vnni = cold(per_row=0.445, draft_share=0.32), cold(per_row=0.14, draft_share=0.32)
    assert avx2.verify_seconds(4) / avx2.t_plain == pytest.approx(2.7, abs=0.1)
    assert vnni.verify_seconds(4) / vnni.t_plain == pytest.approx(1.95, abs=0.1)
    assert avx2.draft_seconds("draft", 1) / avx2.t_plain == pytest.approx(0.49, abs=0.03)  # 23.4 ms measured there
    assert avx2.draft_seconds("ngram", 4) == 0.0 and avx2.feed_seconds("draft") < avx2.draft_seconds("draft", 1)
    assert avx2.k_for("draft", lag=900, horizon=128) == 0 and "draft" not in avx2.probe_after
    for policy in (avx2, vnni):  # what a round teaches: its drafts are kept
        policy.tried["draft"], policy.accepted["draft"] = [40.0] * 8, [36.0] * 8
    assert avx2.k_for("draft", lag=900, horizon=128) == 0  # 90% kept and still no gain there: a 5-row pass is 2.7
    assert vnni.k_for("draft", lag=30, horizon=512) > 0
    assert avx2.k_for("ngram") > 0  # lookup's drafts cost nothing but their rows: tried from the start


def test_a_batch_probes_a_source_plain_decoding_wins_over_once_its_wait_is_over():
    """Under continuous load no sequence is ever alone: the batch probes a source that does not pay now and then (one
    probe a step, PROBE_SHORT drafts), so that it is measured again; a source never timed is priced, not refused."""
    from quickdraft.speculative.policy import PROBE_SHORT, BatchPlan

    policy = cold(per_row=0.445, draft_share=0.32)
    for rows in (2, 3, 4):
        for _ in range(2):
            policy.record_pass(rows, 0.048 * (1 + 0.43 * (rows - 1)))
    cfg = SpeculationConfig(draft_max=8)
    ks, steps = [], 0
    while not any(ks) and steps < 2000:
        plan = BatchPlan(policy, 2, 2, 64)
        ks = [plan.k_for(i, cfg, 8, lag=lambda source: 0)("draft") for i in range(2)]
        policy.record_pass(2, 0.07)
        steps += 1
    assert sorted(ks) == [0, PROBE_SHORT] and 16 <= steps < 2000  # one sequence probes, the other waits its turn
    policy.record_drafts("draft", PROBE_SHORT, 0, 0.05)
    plan = BatchPlan(policy, 2, 2, 64)
    assert [plan.k_for(i, cfg, 8)("draft") for i in range(2)] == [0, 0]  # lost: the next one waits longer


def test_the_rates_a_step_weighs_are_each_ks_predicted_rate():
    """k_for weighs every k from one pass over the prices (predicted_rates, its hot path): each figure is exactly
    predicted_rate's, for a trained policy, one moved to a longer sequence, and a cold one priced by the machine."""
    trained_one = trained(acceptance=0.6, verify_slope=0.1, draft_cost=0.05)
    moved = trained(acceptance=0.4, verify_slope=0.05, draft_cost=0.05)
    moved.position = 100
    for _ in range(4):
        moved.record_plain(1.0)
    moved.position = 5_000
    for _ in range(4):
        moved.record_plain(2.0)
    moved.t_catch_up["draft"] = 0.3  # (a draft model's catch-up after lookup rounds: a cost per round)
    priced = cold(per_row=0.445, draft_share=0.32)
    priced.tried["draft"], priced.accepted["draft"] = [10.0, 8.0, 3.0], [7.0, 4.0, 1.0]
    for policy, source in ((trained_one, "draft"), (moved, "draft"), (priced, "draft"), (priced, "ngram")):
        top = policy.cfg.draft_max
        assert policy.predicted_rates(source, top) == [policy.predicted_rate(source, k) for k in range(1, top + 1)]
