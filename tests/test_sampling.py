"""The p that both decoding paths sample from: filters and their interplay."""

from __future__ import annotations

import numpy as np
import pytest

from specstack.errors import InvalidParameterError
from specstack.sampling import SamplingParams, sample, target_probs

LOGITS = np.log(np.array([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def test_plain_temperature_one_is_softmax():
    p = target_probs(LOGITS, SamplingParams(temperature=1.0))
    assert np.allclose(p, [[0.5, 0.25, 0.15, 0.07, 0.03]])


def test_top_k_keeps_k_most_likely():
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))[0]
    assert np.allclose(p, [0.5 / 0.75, 0.25 / 0.75, 0, 0, 0])


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))[0]
    assert np.count_nonzero(p) == 3  # 0.5 + 0.25 < 0.8 <= 0.9


def test_top_k_then_top_p_renormalises_between_filters():
    # After top-k=3 the masses are 0.555, 0.278, 0.167: top-p 0.8 keeps 2, not 3.
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))[0]
    assert np.count_nonzero(p) == 2


def test_min_p_drops_tokens_below_fraction_of_top():
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.2))[0]
    assert np.count_nonzero(p) == 3  # 0.15 >= 0.1 kept, 0.07 dropped


def test_temperature_applies_after_filters():
    p = target_probs(LOGITS, SamplingParams(temperature=0.5, top_k=2))[0]
    assert np.isclose(p[0], 0.25 / (0.25 + 0.0625))


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"min_p": 1.0}])
def test_invalid_parameters_are_refused(kw):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kw)


def test_sample_never_picks_zero_probability_tokens():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert {sample(probs, rng) for _ in range(200)} == {1, 3}
