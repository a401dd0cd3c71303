import pytest
import torch

from quickdraft import sampling
from quickdraft.config import SamplingParams
from quickdraft.errors import QuickdraftError

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_greedy_is_one_hot_argmax():
    probs = sampling.process(LOGITS, SamplingParams(temperature=0))
    assert probs.tolist() == [[1.0, 0, 0, 0, 0, 0]]
    assert sampling.next_token(LOGITS, SamplingParams(), None, None, 0).item() == 0


def test_temperature_scales_logits():
    probs = sampling.process(LOGITS, SamplingParams(temperature=2.0))
    torch.testing.assert_close(probs, (LOGITS / 2).softmax(-1))


def test_top_k_keeps_k_most_likely():
    probs = sampling.process(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs[0, :2], LOGITS[0, :2].softmax(-1))
    assert probs[0, 2:].sum() == 0


def test_top_p_keeps_smallest_set_reaching_p():
    full = LOGITS.softmax(-1)[0]  # ~[0.574, 0.211, 0.128, 0.078, 0.029, 0.004]
    probs = sampling.process(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))[0]
    kept = (probs > 0).tolist()
    assert kept == [True, True, True, False, False, False]  # 0.574 + 0.211 = 0.785 < 0.8: a third is needed
    torch.testing.assert_close(probs[:3], full[:3] / full[:3].sum())


def test_top_p_always_keeps_the_top_token():
    probs = sampling.process(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))[0]
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = sampling.process(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))[0]
    assert (probs > 0).tolist() == [True, True, False, False, False, False]  # 0.211 / 0.574 = 0.37


def test_repetition_penalty_like_llama_cpp():
    history = torch.tensor([0, 4, 4])
    out = sampling.apply_repetition_penalty(LOGITS, history, 2.0)
    assert out.tolist() == [[1.0, 1.0, 0.5, 0.0, -2.0, -3.0]]
    # greedy with a strong penalty moves off the repeated argmax
    assert sampling.next_token(LOGITS, SamplingParams(repetition_penalty=4.0), history, None, 0).item() == 1


def test_presence_and_frequency_penalties_like_openai():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    history = torch.tensor([1, 1, 1, 3])  # token 1 three times, token 3 once
    out = sampling.penalize(LOGITS, params, history)
    expected = LOGITS.clone()
    expected[0, 1] -= 0.5 + 3 * 0.25
    expected[0, 3] -= 0.5 + 0.25
    torch.testing.assert_close(out, expected)


def test_penalties_look_only_at_the_window():
    params = SamplingParams(frequency_penalty=1.0, repetition_window=2)
    out = sampling.penalize(LOGITS, params, torch.tensor([0, 0, 0, 4, 5]))
    expected = LOGITS.clone()
    expected[0, 4] -= 1
    expected[0, 5] -= 1
    torch.testing.assert_close(out, expected)


def test_unseeded_sampling_follows_probs():
    params = SamplingParams(temperature=1.0)
    probs = sampling.process(LOGITS.expand(20000, -1), params)
    draws = [sampling.sample(probs, sampling.make_generator(7, torch.device("cpu"))) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])  # the same generator seed, the same draws
    freq = torch.bincount(draws[0], minlength=6).float() / len(draws[0])
    torch.testing.assert_close(freq, LOGITS.softmax(-1)[0], atol=0.015, rtol=0)


def test_seeded_gumbel_choice_is_a_function_of_seed_and_position_and_follows_probs():
    probs = sampling.process(LOGITS, SamplingParams(temperature=1.0))
    draws = torch.cat([sampling.gumbel_choice(probs, seed=11, first_position=i) for i in range(20000)])
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)
    rows = sampling.gumbel_choice(probs.expand(50, -1), seed=11, first_position=0)  # many rows at once
    assert torch.equal(rows, draws[:50])  # ... are the same choices as one row at a time
    other_seed = torch.cat([sampling.gumbel_choice(probs, seed=12, first_position=i) for i in range(50)])
    assert not torch.equal(other_seed, draws[:50])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1),
                                 dict(top_k=-1), dict(max_tokens=-5), dict(repetition_penalty=0)])
def test_bad_params_are_clear_errors(bad):
    with pytest.raises(QuickdraftError):
        SamplingParams(**bad)


@pytest.mark.parametrize("kw", [dict(temperature=1e-300), dict(temperature=1e-40),
                                dict(temperature=1.0, repetition_penalty=1e-300)])
def test_extreme_parameters_give_a_distribution_not_nan(kw):
    """A request may ask for a temperature or penalty that over- or underflows float32: sampling must still
    get a distribution (a server once answered 500 'probability tensor contains nan')."""
    probs = sampling.process(torch.tensor([[3.0, -1.0, 2.0, 0.5]]), SamplingParams(**kw), torch.tensor([0, 2]))
    assert not probs.isnan().any() and torch.allclose(probs.sum(-1), torch.tensor(1.0))
