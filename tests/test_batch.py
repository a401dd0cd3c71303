"""Continuous batching: several sequences stepped in one target pass (Transformer.forward_segments, engine.Batch).

Every sequence's output must be the one it gets alone, token for token (greedy and seeded), whatever runs beside it:
the rows of a batched pass are computed as each sequence's own pass computes them."""

import dataclasses

import pytest
import torch

from quickdraft.config import EngineConfig
from quickdraft.runtime.kv_cache import KVCache
from quickdraft.weights.loader import load_model
from tests.helpers import save_hf_dir, tiny_hf_model
from tests.test_prefix_reuse import build

BF16 = EngineConfig(device="cpu", dtype="bfloat16", weights="bf16", max_context=256)
PROMPTS = [[(5 * i + j) % 300 + 3 for i in range(n)] for j, n in enumerate((9, 70, 23))]


def _caches(model, prompts):
    """A cache per prompt, each filled by that prompt's prefill (in row-wise chunks, as the engine prefills)."""
    caches = []
    for p in prompts:
        cache = KVCache.for_model(model, 256)
        for i in range(0, len(p), 64):
            model(torch.tensor([p[i:i + 64]]), cache)
        caches.append(cache)
    return caches


def _state(cache):
    n = cache.length
    kv = [t[:, :, :n].clone() for t in cache.tensors()]
    return kv + [s.ssm.clone() for s in cache.recurrent] + [s.conv.clone() for s in cache.recurrent]


def _check_segments_equal_alone(model, feeds_per_step):
    alone, batched = _caches(model, PROMPTS), _caches(model, PROMPTS)
    for feeds in feeds_per_step:
        last = [len(f) > 3 for f in feeds]  # some sequences want every row's logits, some their last
        got = model.forward_segments([torch.tensor(f) for f in feeds], batched, last)
        for f, cache, want_last, logits in zip(feeds, alone, last, got):
            ref = model(torch.tensor([f]), cache, last_only=want_last)[0]
            assert torch.equal(ref, logits)
    for a, b in zip(alone, batched):
        assert a.length == b.length
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


STEPS = [[[4], [7, 8, 9, 10, 11], [12, 13, 14]], [[5, 6], [15], [16, 17, 18, 19, 20, 21, 22, 23, 24]],
         [[25], [26], [27]]]


@pytest.mark.parametrize("name", ["llama3", "mistral-window", "gemma2", "gemma3", "gemma4", "phi3", "qwen3_5",
                                  "qwen3_5_moe"])
def test_a_batched_pass_gives_each_sequence_its_own_logits_bit_for_bit(tmp_path, name):
    lm = load_model(str(build(name, tmp_path / name)), BF16, False)
    with torch.inference_mode():
        _check_segments_equal_alone(lm.model, STEPS)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_batched_pass_on_the_cpu_kernels_equals_each_alone(tmp_path, weights):
    """On quickdraft's kernels (int4/int8 linears, a decoder layer as one call alone, decode attention), sizes they
    take: the batched pass runs the layers module by module, and must still match each sequence's fused step."""
    hf = tiny_hf_model("qwen2", seed=3, vocab=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2)
    lm = load_model(str(save_hf_dir(hf, tmp_path / "m")), dataclasses.replace(BF16, weights=weights), False)
    if lm.plan.get("fused_layers", 0) == 0:
        pytest.skip(f"quickdraft's fused kernels do not run here: {lm.plan}")
    with torch.inference_mode():
        _check_segments_equal_alone(lm.model, STEPS)


def test_a_batched_pass_is_refused_past_its_rows(tmp_path):
    lm = load_model(str(build("llama3", tmp_path / "m")), BF16, False)
    caches = _caches(lm.model, PROMPTS[:2])
    with pytest.raises(ValueError, match="rows"):
        lm.model.forward_segments([torch.ones(40, dtype=torch.long)] * 2, caches, [True, True])


# ---- the engine: Batch ---------------------------------------------------------------------------------------

from quickdraft.config import SamplingParams, SpeculationConfig  # noqa: E402
from quickdraft.engine import Batch, Engine, Halt  # noqa: E402
from quickdraft.grammar import Grammar  # noqa: E402
from quickdraft.speculative.ngram import NgramDrafter  # noqa: E402
from tests.helpers import byte_level_pair, drafter  # noqa: E402

CTX = 256


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return byte_level_pair(tmp_path_factory.mktemp("batch"), BF16)


def requests(target, sampled: bool):
    """Mixed prompts (one long enough to prefill in several chunks beside the others), lengths, speculation settings
    and a constraint."""
    enc = target.tokenizer.encode
    spec_off, spec_fixed = SpeculationConfig(draft_max=0), SpeculationConfig(draft_max=4, adaptive=False)

    def params(n, seed):
        if not sampled:
            return SamplingParams(max_tokens=n, stop_at_eos=False)
        return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=n, stop_at_eos=False)

    return [
        dict(prompt=enc("the cat sat on the mat; the cat sat on the"), params=params(24, 1), speculation=None),
        dict(prompt=enc("abcabcabc " * 14), params=params(30, 2), speculation=spec_fixed),
        dict(prompt=enc("x"), params=params(9, 3), speculation=spec_off),
        dict(prompt=enc("answer: "), params=params(20, 4), speculation=spec_fixed,
             grammar=Grammar("regex", r"[a-c]{2,5}@(x|yz)\.(com|org)")),
        dict(prompt=enc("one two three four one two three"), params=params(16, 5), speculation=None),
    ]


def make_drafter(kind, target, draft):
    if kind == "ngram":
        return NgramDrafter()
    return drafter(kind, target, draft) if kind != "none" else None


def alone(target, draft, kind, request):
    engine = Engine(target, CTX, make_drafter(kind, target, draft), SpeculationConfig(draft_max=4))
    grammar = request.get("grammar")
    events = list(engine.generate(request["prompt"], request["params"], request["speculation"],
                                  constraint=engine.constraint(grammar) if grammar else None))
    return [e.token for e in events if e.token is not None], events[-1].finish_reason


def batched(target, draft, kind, reqs, parallel=3, cancel_after=None, rejected=None):
    """Run reqs through a Batch of `parallel` sequences, each arriving once there is room (late arrivals):
    {request index: (tokens, finish reason)}; request cancel_after[0] is cancelled after cancel_after[1] tokens.
    rejected: a list given gets the drafts rejected on each step that ran several sequences (rollbacks in a batch)."""
    engine = Engine(target, CTX, make_drafter(kind, target, draft), SpeculationConfig(draft_max=4),
                    slots=parallel + 1)
    batch = Batch(engine, parallel)
    out, index, waiting, rows, drafted = {}, {}, list(range(len(reqs))), [], []

    def deliver(s, event):
        i = index[id(s)]
        assert not isinstance(event, Exception), event
        tokens, _ = out.setdefault(i, ([], None))
        if event.token is not None:
            tokens.append(event.token)
            if together:
                drafted.append(event.k)
            if cancel_after and cancel_after[0] == i and len(tokens) == cancel_after[1]:
                s.halt.reason = "cancelled"
        else:
            out[i] = (tokens, event.finish_reason)

    steps = 0
    while waiting or batch.active:
        while waiting and batch.room() and (steps > 0 or len(batch.active) < 2):  # two first, the rest later
            r = reqs[waiting.pop(0)]
            grammar = r.get("grammar")
            s = batch.add(r["prompt"], r["params"], r["speculation"], Halt(),
                          engine.constraint(grammar) if grammar else None)
            index[id(s)] = len(reqs) - len(waiting) - 1
        together = len(batch.active) > 1
        stepped = [(q, q.stats.draft_n - q.stats.draft_n_accepted) for q in batch.active]
        batch.step(deliver)
        if together and rejected is not None:
            rejected.append(sum(q.stats.draft_n - q.stats.draft_n_accepted - before for q, before in stepped))
        rows.append(batch.last_rows)
        steps += 1
    return out, rows, drafted


@pytest.mark.parametrize("kind", ["none", "ngram", "draft", "combined"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_sequence_of_a_batch_gets_what_it_gets_alone(pair, kind, sampled, monkeypatch):
    """Each request's tokens as alone, whatever runs beside it; the draft model's passes of the sequences drafting in a
    step ran as one pass (DraftModelDrafter.batched_pass over several sequences' rows)."""
    from quickdraft.speculative.draft_model import DraftModelDrafter

    target, draft = pair
    reqs = requests(target, sampled)
    want = [alone(target, draft, kind, r) for r in reqs]
    together, batched_pass = [], DraftModelDrafter.batched_pass

    def counted(self, drafters, feeds):
        together.append(len(drafters))
        return batched_pass(self, drafters, feeds)

    monkeypatch.setattr(DraftModelDrafter, "batched_pass", counted)
    rejected = []
    got, rows, drafted = batched(target, draft, kind, reqs, rejected=rejected)
    assert [got[i] for i in range(len(reqs))] == want
    assert max(rows) > 8  # passes held several sequences' rows (a prefill chunk beside decoding ones)
    assert kind in ("none", "ngram") or max(drafted) > 0  # and their drafts (lookup's depend on the text)
    assert kind in ("none", "ngram") or sum(rejected) > 0  # some cut in a batched pass: the rollback path
    assert kind != "draft" or max(together) > 1  # drafted in one pass of the draft model (combined: lookup often)


def test_hybrid_sequences_roll_back_their_own_recurrent_states_in_a_batch(tmp_path):
    """qwen3.5's linear-attention layers: each sequence's recurrent state advances over its rows of the batched
    pass and returns to its last accepted draft, whatever the others accept."""
    target = load_model(str(build("qwen3_5", tmp_path / "m")), BF16, False)
    spec = SpeculationConfig(draft_max=5, adaptive=False)
    params = SamplingParams(max_tokens=24, stop_at_eos=False)
    reqs = [dict(prompt=p, params=params, speculation=spec) for p in ([4, 5, 6, 4, 5, 6, 4, 5], PROMPTS[1], [9] * 12)]
    want = [alone(target, None, "ngram", r) for r in reqs]
    got, _, drafted = batched(target, None, "ngram", reqs)
    assert [got[i] for i in range(len(reqs))] == want
    assert max(drafted) > 0


def test_a_cancelled_sequence_ends_at_once_and_the_others_go_on(pair):
    target, draft = pair
    reqs = requests(target, False)
    want = [alone(target, draft, "combined", r) for r in reqs]
    got, _, _ = batched(target, draft, "combined", reqs, cancel_after=(1, 5))
    assert got[1] == (want[1][0][:5], "cancelled")
    assert [got[i] for i in (0, 2, 3, 4)] == [want[i] for i in (0, 2, 3, 4)]


def test_a_request_that_fails_leaves_no_slot_running(pair):
    """Batch.run raises what a request fails with (here a prompt past the context), and every other sequence of the
    batch ends with it: its slot free again, the engine serving the next request."""
    from quickdraft.errors import QuickdraftError

    target, draft = pair
    engine = Engine(target, CTX, make_drafter("combined", target, draft), SpeculationConfig(draft_max=4), slots=3)
    params = SamplingParams(max_tokens=8, stop_at_eos=False)
    ok = dict(prompt=target.tokenizer.encode("hello there"), params=params, speculation=None)
    with pytest.raises(QuickdraftError, match="context"):
        Batch(engine, 3).run([ok, ok, dict(prompt=[5] * CTX, params=params)])
    assert engine.slots.free() == 3
    assert [e.token for e in engine.generate(**ok)][:-1] == alone(target, draft, "combined", ok)[0]


def test_a_batch_keeps_a_row_for_each_sequence_and_a_newcomer(pair):
    engine = Engine(pair[0], CTX, slots=100)
    assert Batch(engine, 100).parallel == engine.target.chunk - 1


def test_a_short_prompt_behind_a_long_one_is_prefilled_first_and_a_prefill_beside_streams_takes_its_share(pair):
    """A long prompt prefills a chunk a step; a short one added behind it is prefilled in the next step (the shortest
    first) and has its first token then; once it decodes, the long prompt's chunks beside it take no more rows than
    the scheduler's prefill budget (its pass within SLOWDOWN of a decoding step); each gets what it gets alone."""
    from quickdraft.engine import scheduler

    target, draft = pair
    enc = target.tokenizer.encode
    long_prompt, short_prompt = enc("a long prompt, " * 14), enc("hi")
    assert len(long_prompt) > 3 * 64
    params = SamplingParams(max_tokens=12, stop_at_eos=False)
    engine = Engine(target, CTX, None, SpeculationConfig(draft_max=0), slots=3)
    batch = Batch(engine, 2)
    got: dict = {}
    deliver = lambda s, e: got.setdefault(id(s), []).append(e)  # noqa: E731
    long = batch.add(long_prompt, params)
    batch.step(deliver)  # its first chunk
    short = batch.add(short_prompt, params)
    batch.step(deliver)
    assert [e.token for e in got[id(short)]] and id(long) not in got  # the short one's first token, and not the long's
    for rows in (2, 8, 16, 32, 64):  # what passes cost here, made up: 1 plain step + 1/16 of one per row
        for _ in range(2):
            engine.policy.record_pass(rows, 1 + rows / 16)
    engine.policy.t_plain = 1.0
    budget = engine.scheduler.budget(1)
    assert budget == 15 and engine.policy.pass_seconds(1 + budget) <= scheduler.SLOWDOWN * engine.policy.t_plain
    batch.step(deliver)
    assert batch.last_rows == 1 + budget
    while batch.active:
        batch.step(deliver)
    for s, prompt in ((long, long_prompt), (short, short_prompt)):
        tokens = [e.token for e in got[id(s)] if e.token is not None]
        assert tokens == [e.token for e in Engine(target, CTX).generate(prompt, params) if e.token is not None]


def test_a_long_prompt_passed_over_for_shorter_ones_goes_first_after_a_few_steps(pair):
    """Shortest first, but not for ever: short prompts that fill a step's rows every step would hold a long one back
    indefinitely; one passed over STARVED steps in a row is prefilled before them."""
    from quickdraft.engine.scheduler import STARVED

    target, _ = pair
    enc = target.tokenizer.encode
    engine = Engine(target, CTX, None, SpeculationConfig(draft_max=0), slots=STARVED + 3)
    params = SamplingParams(max_tokens=4, stop_at_eos=False)
    long = engine.start(enc("a long prompt, " * 14), params)
    for step in range(STARVED + 1):
        short = engine.start(enc("short " * 40)[:engine.max_rows], params)  # as many rows as a step has
        planned = engine.plan([long, short])
        assert (long in planned.sequences) == (step == STARVED), step
        assert planned.sequences[0] is (long if step == STARVED else short)
        engine.release(short)


@pytest.mark.parametrize("kind", ["none", "draft"])
def test_requests_arriving_together_prefill_their_shared_beginning_once(pair, kind):
    """Three requests under one system prompt (agents of one framework) start together, none of it in a kept slot:
    the first prefills it, the others wait for it and copy it (keys and values, the draft's share) rather than
    prefill it three times; each answer is its cold answer alone, greedy and seeded."""
    target, draft = pair
    enc = target.tokenizer.encode
    system = enc("You are one of a team of careful agents. Answer briefly. " * 3)
    assert len(system) > 2 * 64  # more than two prefill chunks
    prompts = [system + enc(task) for task in ("Task: add 2 and 3.", "Task: name a colour.", "Task: say hello.")]
    for params in (SamplingParams(max_tokens=12, stop_at_eos=False),
                   SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=12, stop_at_eos=False)):
        engine = Engine(target, CTX, make_drafter(kind, target, draft), SpeculationConfig(draft_max=4), slots=4)
        batch = Batch(engine, 3)
        got: dict = {}
        seqs = [batch.add(prompt, params) for prompt in prompts]
        prefilled, run = [0], engine.run

        def counted(p):  # the rows of prompt each pass ran
            prefilled[0] += sum(len(f) for f, chunk in zip(p.feeds, p.prefill) if chunk)
            return run(p)

        engine.run = counted
        while batch.active:
            batch.step(lambda q, e: got.setdefault(id(q), []).append(e))
        for q, prompt in zip(seqs, prompts):
            cold = Engine(target, CTX, make_drafter(kind, target, draft), SpeculationConfig(draft_max=4))
            want = [e.token for e in cold.generate(prompt, params, reuse=False) if e.token is not None]
            assert [e.token for e in got[id(q)] if e.token is not None] == want
        reused = sorted(q.timings.cache_n for q in seqs)  # (the shortest prompt went first)
        assert reused[0] == 0 and reused[1] >= len(system), reused
        assert prefilled[0] == sum(len(p) for p in prompts) - sum(reused)  # the system prompt's rows ran once


def test_unseeded_samples_in_a_batch_have_the_target_distribution(tmp_path):
    """Three sequences of one prompt stepped together, unseeded at T = 0.7, each verifying chains of 2 drafts in the
    batched pass (rejection sampling per sequence): the second and third tokens each emits are distributed as the
    target's two- and three-step distributions (chi-square over 3 x 300 answers, a vocabulary of 24)."""
    from quickdraft.speculative.draft_model import DraftModelDrafter
    from tests.helpers import add_noise, assert_second_and_third_follow, two_and_three_step

    f32 = dataclasses.replace(BF16, dtype="float32")
    target = load_model(str(save_hf_dir(tiny_hf_model("qwen2", seed=0, vocab=24, logit_scale=2), tmp_path / "t")),
                        f32, False)
    draft = load_model(str(save_hf_dir(add_noise(tiny_hf_model("qwen2", seed=0, vocab=24, logit_scale=2), 0.3),
                                       tmp_path / "d")), f32, False)
    prompt, V = [1, 2, 3], 24
    params = SamplingParams(temperature=0.7, max_tokens=4, stop_at_eos=False)
    exact = two_and_three_step(target, prompt, params)
    spec = SpeculationConfig(draft_max=2, adaptive=False, p_min=0.0)
    engine = Engine(target, 16, DraftModelDrafter(draft, V, 16, 0.0), spec, slots=4)
    counts = torch.zeros(2, V, dtype=torch.float64)
    torch.manual_seed(0)
    for _ in range(300):
        for events in Batch(engine, 3).run([dict(prompt=prompt, params=params)] * 3):
            tokens = [e.token for e in events if e.token is not None]
            counts[0, tokens[1]] += 1
            counts[1, tokens[2]] += 1
            assert events[-1].stats.k_history[0] == 2
    assert_second_and_third_follow(counts, exact)
