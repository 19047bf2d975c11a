"""On-device sampling against its definition, row by row."""

import jax
import numpy as np
import pytest

from jaxserve.engine.sampler import row_seed, sample, sampling_tensors
from jaxserve.sampling_params import SamplingParams

PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
sample_jit = jax.jit(sample)


def draw(params: SamplingParams, num_draws: int, probs=PROBS, token_index=0):
    """Samples one token for each of `num_draws` seeds from the same distribution."""
    logits = np.tile(np.log(probs), (num_draws, 1))
    rows = [(params, seed, token_index) for seed in range(num_draws)]
    return np.asarray(sample_jit(logits, sampling_tensors(rows, num_draws)))


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(5, 300)).astype(np.float32)
    rows = [(SamplingParams(temperature=0), 0, 0)] * 5
    assert (np.asarray(sample_jit(logits, sampling_tensors(rows, 5))) == logits.argmax(-1)).all()


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draw(SamplingParams(temperature=1.0), 4000), minlength=4) / 4000
    np.testing.assert_allclose(counts, PROBS, atol=0.03)


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),          # 0.5 + 0.3 reaches 0.7
    (SamplingParams(top_p=0.5), {0}),
    (SamplingParams(min_p=0.4), {0, 1}),          # p >= 0.4 * 0.5 = 0.2
    (SamplingParams(min_p=0.25), {0, 1, 2}),      # p >= 0.125
    (SamplingParams(top_k=1, temperature=5.0), {0}),
])
def test_truncation_keeps_exactly_the_allowed_tokens(params, allowed):
    assert set(draw(params, 500).tolist()) == allowed


def test_top_p_applies_to_what_top_k_left():
    # After top_k=3 the renormalised mass of tokens 0 and 1 is 0.8/0.95 = 0.84 < 0.85: token 2 stays.
    assert set(draw(SamplingParams(top_k=3, top_p=0.85), 800).tolist()) == {0, 1, 2}


def test_seeded_rows_ignore_their_neighbours():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = sample_jit(logits[:1], sampling_tensors([(params, 42, 3)], 1))
    mixed_rows = [(params, 42, 3)] + [(SamplingParams(temperature=0.7, top_p=0.9), i, 0) for i in range(5)]
    together = sample_jit(np.concatenate([logits[:1], logits[1:]]), sampling_tensors(mixed_rows, 6))
    assert int(alone[0]) == int(together[0])


def test_row_seeds_differ_by_seed_and_token_index():
    seeds = {row_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**32 for s in seeds)


def test_padding_rows_are_greedy():
    tensors = sampling_tensors([None, (SamplingParams(), 1, 0)], 3)
    assert tensors.temperature.tolist() == [0, 1, 0]
