"""On-device sampling against its definition, row by row."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.sampler import (PLACEHOLDER, _candidate_thresholds, _past_candidates, _penalize, _threshold,
                                    _bisection_threshold, argmax, count_samples, fill_slots, gumbel_noise, row_seed,
                                    row_seeds, sample, sampling_tensors)
from jaxserve.engine.scheduler_output import ScheduledSequence
from jaxserve.sampling_params import SamplingParams

PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
HISTORY = 32
_sample_jit = jax.jit(sample)


def row(params, seed=0, token_index=0, prompt=(), output=(), suppressed=()):
    return ScheduledSequence("r", (1,), 0, (1,), True, params, seed, token_index, (*prompt, *output), len(prompt),
                             suppressed)


def tensors(rows, num_rows, vocab):
    return sampling_tensors(rows, num_rows, vocab, HISTORY)


def sample_jit(logits, rows, num_rows=None):
    """The sampled tokens of `rows` ([S] ScheduledSequence or None) over `logits`."""
    samples = _sample_jit(logits, tensors(rows, num_rows or len(rows), logits.shape[-1]))
    return np.asarray(samples.tokens)


def draw(params: SamplingParams, num_draws: int, probs=PROBS, token_index=0):
    """Samples one token for each of `num_draws` seeds from the same distribution."""
    logits = np.tile(np.log(probs), (num_draws, 1))
    return sample_jit(logits, [row(params, seed, token_index) for seed in range(num_draws)])


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(5, 300)).astype(np.float32)
    assert (sample_jit(logits, [row(SamplingParams(temperature=0))] * 5) == logits.argmax(-1)).all()


def test_argmax_is_numpys_first_largest_index():
    rng = np.random.default_rng(7)
    values = rng.integers(-3, 4, size=(64, 300)).astype(np.float32)   # many ties for the largest
    values[1] = -np.inf                                               # every token masked: index 0
    values[2, [5, 9]] = np.inf
    values[3] = rng.normal(size=300)
    np.testing.assert_array_equal(jax.jit(argmax)(values), values.argmax(-1))
    values[4, 11] = np.nan   # a row with a NaN still gets a token in range (`finite` flags it)
    assert 0 <= int(jax.jit(argmax)(values)[4]) < 300


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draw(SamplingParams(temperature=1.0), 4000), minlength=4) / 4000
    np.testing.assert_allclose(counts, PROBS, atol=0.03)


def test_temperature_one_follows_the_distribution_across_a_large_vocabulary():
    probs = np.zeros(4096, np.float32)
    likely = [3, 1000, 2047, 4095]
    probs[likely] = [0.4, 0.3, 0.2, 0.1]
    with np.errstate(divide="ignore"):   # log(0) = -inf: never sampled
        tokens = draw(SamplingParams(temperature=1.0), 3000, probs=probs)
    assert set(tokens.tolist()) <= set(likely)
    np.testing.assert_allclose(np.bincount(tokens, minlength=4096)[likely] / 3000, probs[likely], atol=0.03)


def test_gumbel_noise_is_standard_gumbel_and_depends_only_on_the_seed():
    seeds = np.array([row_seed(s, i) for s in range(8) for i in range(8)], np.uint32)
    noise = np.asarray(jax.jit(gumbel_noise, static_argnums=1)(seeds, 49152), np.float64)
    # 3.1M draws: the bounds are 7 or more standard errors wide
    assert abs(noise.mean() - np.euler_gamma) < 0.005 and abs(noise.var() - np.pi**2 / 6) < 0.02
    assert abs((noise < 0).mean() - np.exp(-1)) < 0.002   # P(G < 0) = exp(-exp(0))
    correlations = np.corrcoef(noise[:16])[~np.eye(16, dtype=bool)]   # rows of other seeds
    assert np.abs(correlations).max() < 0.025
    assert abs(np.corrcoef(noise[:, :-1].ravel(), noise[:, 1:].ravel())[0, 1]) < 0.005   # neighbouring tokens
    np.testing.assert_array_equal(gumbel_noise(seeds[[5, 2]], 49152), noise[[5, 2]].astype(np.float32))


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


def test_thresholds_from_the_candidates_equal_those_by_bisection():
    rng = np.random.default_rng(8)
    logits = np.round(rng.normal(size=(24, 5000)) * 2, 1).astype(np.float32)   # rounded: ties
    logits[:, :30] += np.linspace(12, 4, 30, dtype=np.float32)                 # peaked, as a model's
    logits[3, 100:140] = -np.inf                                               # masked tokens
    params = [SamplingParams(temperature=1.0, top_k=int(rng.choice([0, 1, 5, 40, 256])),
                             top_p=float(rng.choice([1.0, 0.3, 0.9, 0.99])), min_p=float(rng.choice([0, 0.01, 0.2])))
              for _ in range(24)]
    st = tensors([row(p) for p in params], 24, 5000)
    threshold, wider = jax.jit(_candidate_thresholds)(logits, st)
    assert not np.asarray(wider).any()
    kept = logits >= np.asarray(jax.jit(_bisection_threshold)(logits, st))[:, None]
    np.testing.assert_array_equal(logits >= np.asarray(threshold)[:, None], kept)
    assert len(set(kept.sum(-1).tolist())) > 8                                  # the settings cut variously
    assert not np.asarray(jax.jit(_past_candidates)(logits, st)).any()
    # A top-k past the candidates, or a top-p they do not reach, goes to bisection; the top-k, and
    # the top-p of a flat row (its largest probability 256 times over is short of it), before
    # the candidates are sought.
    flat = np.zeros((1, 5000), np.float32)
    for wide, last, past in ((SamplingParams(temperature=1.0, top_k=1000), logits[5:6], True),
                             (SamplingParams(temperature=1.0, top_p=0.999999), logits[5:6], False),
                             (SamplingParams(temperature=1.0, top_p=0.9), flat, True)):
        rows = np.concatenate([logits[:5], last])
        st = tensors([row(p) for p in params[:5]] + [row(wide)], 6, 5000)
        assert np.asarray(jax.jit(_candidate_thresholds)(rows, st)[1]).tolist() == [False] * 5 + [True]
        assert np.asarray(jax.jit(_past_candidates)(rows, st)).tolist() == [False] * 5 + [past]
        np.testing.assert_array_equal(rows >= np.asarray(jax.jit(_threshold)(rows, st))[:, None],
                                      rows >= np.asarray(jax.jit(_bisection_threshold)(rows, st))[:, None])


def test_top_p_applies_to_what_top_k_left():
    # After top_k=3 the renormalised mass of tokens 0 and 1 is 0.8/0.95 = 0.84 < 0.85: token 2 stays.
    assert set(draw(SamplingParams(top_k=3, top_p=0.85), 800).tolist()) == {0, 1, 2}


def test_seeded_rows_ignore_their_neighbours():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = sample_jit(logits[:1], [row(params, 42, 3)])
    mixed_rows = [row(params, 42, 3)] + [row(SamplingParams(temperature=0.7, top_p=0.9), i) for i in range(5)]
    together = sample_jit(logits, mixed_rows)
    assert int(alone[0]) == int(together[0])


@pytest.mark.parametrize("neighbour", [dict(params=SamplingParams(temperature=0.7, logit_bias={3: 5.0})),
                                       dict(params=SamplingParams(temperature=0.7, frequency_penalty=1.0),
                                            output=(3, 3, 5)),
                                       dict(params=SamplingParams(temperature=0), suppressed=(7,))])
def test_a_neighbour_with_changed_logits_leaves_the_other_rows_tokens_alone(neighbour):
    """A step with a bias, a penalty or a suppressed token picks every row's token from a changed
    copy of the logits, a step without them from the logits themselves: the same tokens either way."""
    logits = np.random.default_rng(2).normal(size=(8, 1000)).astype(np.float32) * 3
    plain = [row(SamplingParams(temperature=t, top_p=p), seed=i, token_index=i)
             for i, (t, p) in enumerate([(0, 1), (0.7, 1), (1.0, 0.9), (0.5, 1), (0, 1), (1.2, 0.95), (0.7, 1)])]
    alone = sample_jit(logits, [*plain, None])
    together = sample_jit(logits, [*plain, row(seed=9, **neighbour)])
    np.testing.assert_array_equal(alone[:7], together[:7])


def test_row_seeds_differ_by_seed_and_token_index():
    seeds = {row_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**32 for s in seeds)


def splitmix64(seed: int, token_index: int) -> int:
    """The reference, in Python's integers."""
    mask = 2**64 - 1
    z = (seed * 0x9E3779B97F4A7C15 + token_index + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def test_row_seeds_are_splitmix64_of_the_seed_and_the_token_index():
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**63 - 1, *(int(s) for s in rng.integers(0, 2**63, 200))]
    indices = [0, -1, 5, *(int(i) for i in rng.integers(-8, 10_000, 200))]   # n > 1 draws at -1 - i
    assert row_seeds(seeds, indices).tolist() == [splitmix64(s, i) for s, i in zip(seeds, indices)]
    assert row_seeds(seeds, indices).dtype == np.uint32 and row_seed(seeds[2], 7) == splitmix64(seeds[2], 7)


def test_padding_rows_are_greedy():
    assert tensors([None, row(SamplingParams(), 1)], 3, 4).temperature.tolist() == [0, 1, 0]


def reference_processed_logits(logits, params, prompt, output, suppressed):
    """The sampler's logit processing, written plainly in NumPy for one row."""
    x = logits.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        x[token] += bias
    x[list(suppressed)] = -np.inf
    for token in set(prompt) | set(output):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return x


@pytest.mark.parametrize("seed", range(4))
def test_penalties_bias_and_min_tokens_match_numpy(seed):
    rng = np.random.default_rng(seed)
    vocab, num_rows = 50, 6
    logits = rng.normal(scale=3, size=(num_rows, vocab)).astype(np.float32)
    rows, expected = [], []
    for i in range(num_rows):
        params = SamplingParams(
            temperature=0, presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.uniform(0.5, 2)),
            logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.choice(vocab, 4, replace=False)})
        prompt = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        output = rng.integers(0, vocab, int(rng.integers(0, 12))).tolist()
        suppressed = tuple(rng.choice(vocab, 2, replace=False).tolist()) if i % 2 else ()
        rows.append(row(params, prompt=prompt, output=output, suppressed=suppressed))
        expected.append(reference_processed_logits(logits[i], params, prompt, output, suppressed))
    assert sample_jit(logits, rows).tolist() == [int(np.argmax(e)) for e in expected]   # greedy sees them
    t = tensors(rows, num_rows, vocab)
    biased = logits.copy()
    for i, r in enumerate(rows):
        for token, bias in r.params.logit_bias:
            biased[i, token] += bias
        biased[i, list(r.suppressed_token_ids)] = -np.inf
    processed = np.asarray(jax.jit(_penalize)(biased, t))   # the whole rows, not just their argmax
    np.testing.assert_allclose(processed, np.array(expected), rtol=1e-5, atol=1e-5)


def test_a_placeholder_in_a_penalised_history_counts_the_rows_last_token():
    """Async scheduling: a penalised row whose last token is still on the device has PLACEHOLDER
    in its history, filled from its input token: as if the host had the token."""
    rng = np.random.default_rng(7)
    vocab, prompt, output, last = 50, [3, 9, 9, 4], [9, 11], 11
    params = SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4)
    known = tensors([row(params, prompt=prompt, output=(*output, last))], 1, vocab)
    held = tensors([dataclasses.replace(row(params, prompt=prompt, output=output), placeholder=True)], 1, vocab)
    assert PLACEHOLDER in held.history[0]
    logits = rng.normal(scale=3, size=(1, vocab)).astype(np.float32)
    np.testing.assert_allclose(jax.jit(_penalize)(logits, held, np.array([last], np.int32)),
                               jax.jit(_penalize)(logits, known), rtol=1e-6)
    assert not np.allclose(jax.jit(_penalize)(logits, held, np.array([5], np.int32)), jax.jit(_penalize)(logits, known))


def test_min_tokens_suppression_masks_the_ids():
    logits = np.log(np.tile(PROBS, (1, 1)))
    assert sample_jit(logits, [row(SamplingParams(temperature=0), suppressed=(0, 1))]).tolist() == [2]


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 100)).astype(np.float32)
    rows = [row(SamplingParams(temperature=0, logprobs=5, presence_penalty=1.0), output=(7,)),
            row(SamplingParams(temperature=1.0, seed=1, logprobs=0), seed=1), None]
    samples = jax.device_get(_sample_jit(logits, tensors(rows, 3, 100)))
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for i in range(2):
        np.testing.assert_allclose(samples.logprob[i], log_softmax[i, samples.tokens[i]], atol=1e-5)
        order = np.argsort(-log_softmax[i])[:20]
        assert samples.top_ids[i].tolist() == order.tolist()
        np.testing.assert_allclose(samples.top_logprobs[i], log_softmax[i, order], atol=1e-5)


def packed(allowed_ids, vocab):
    """A packed allowed-token mask row: bit t % 32 of word t // 32 set for each allowed t."""
    bits = np.zeros(-(-vocab // 32) * 32, np.uint8)
    bits[list(allowed_ids)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                                    SamplingParams(top_k=3), SamplingParams(top_p=0.5, min_p=0.1)])
def test_masked_rows_sample_only_allowed_tokens_and_others_are_unchanged(params):
    rng = np.random.default_rng(1)
    vocab, allowed = 300, {7, 64, 65, 250, 299}
    logits = rng.normal(size=(8, vocab)).astype(np.float32)
    rows = [row(params, seed) for seed in range(8)]
    alone = sample_jit(logits, rows)
    masks = {"r": packed(allowed, vocab)}   # every row is "r": mask them all, then only the odd ones
    masked = _sample_jit(logits, sampling_tensors(rows, 8, vocab, HISTORY, masks)).tokens
    assert set(np.asarray(masked).tolist()) <= allowed
    half = sampling_tensors(rows, 8, vocab, HISTORY, masks)
    half = half.replace(allowed=np.where(np.arange(8)[:, None] % 2 == 1, half.allowed, -1))
    tokens = np.asarray(_sample_jit(logits, half).tokens)
    assert set(tokens[1::2].tolist()) <= allowed
    assert (tokens[0::2] == alone[0::2]).all()


def test_truncation_still_applies_beside_suppressed_tokens():
    # A suppressed (-inf) token once made top-k's bisection start at -inf and keep every token.
    reference = draw(SamplingParams(top_k=2), 500)
    logits = np.tile(np.log(PROBS), (500, 1))
    rows = [row(SamplingParams(top_k=2, min_tokens=1), seed, suppressed=(3,)) for seed in range(500)]
    assert set(sample_jit(logits, rows).tolist()) == {0, 1} == set(reference.tolist())


@pytest.mark.parametrize("logprobs", [None, 2])
def test_rows_with_nan_or_inf_logits_are_flagged(logprobs):
    logits = np.random.default_rng(4).normal(size=(6, 50)).astype(np.float32) * 1e4
    logits[1, 7], logits[2, 3], logits[4, 0] = np.nan, np.inf, -np.inf
    logits[5, 1], logits[5, 2] = np.inf, -np.inf   # together, they sum to NaN
    rows = [row(SamplingParams(temperature=t, seed=1, logprobs=logprobs), seed=1) for t in (0, 0.8, 0, 1.0, 0, 0.5)]
    samples = jax.device_get(_sample_jit(logits, tensors(rows, 6, 50)))
    assert samples.finite.tolist() == [True, False, False, True, False, False]


def test_penalties_from_slots_equal_penalties_from_histories():
    """A step that fills its rows' penalty slots from their histories (whatever the slots held)
    penalises as the histories do; the slots then count the sampled tokens, so that the next step
    sends no history and penalises as the histories with those tokens would."""
    rng = np.random.default_rng(11)
    vocab, num_rows = 40, 4
    params = SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.3)

    def rows_of(histories):
        return [dataclasses.replace(row(params, token_index=len(output), prompt=prompt, output=output),
                                    request_id=f"r{i}") for i, (prompt, output) in enumerate(histories)] + [None]

    histories = [(rng.integers(0, vocab, 5).tolist(), rng.integers(0, vocab, k).tolist()) for k in (0, 3, 7)]
    slots = PenaltySlots(6)
    counts = jnp.full((6, vocab), 5, jnp.int32)   # what other sequences left there
    for step in range(3):
        rows = rows_of(histories)
        t = sampling_tensors(rows, num_rows, vocab, HISTORY, penalty_slots=slots)
        assert (t.history[:3, 0] != vocab).all() == (step == 0) and not (t.history[3] != vocab).any()
        counts = jax.jit(fill_slots)(counts, t, jnp.zeros(num_rows, jnp.int32))
        logits = rng.normal(scale=3, size=(num_rows, vocab)).astype(np.float32)
        penalised = jax.jit(_penalize)(logits, t, None, counts)
        np.testing.assert_allclose(penalised, jax.jit(_penalize)(logits, tensors(rows, num_rows, vocab)), rtol=1e-6)
        tokens = np.argmax(np.asarray(penalised), -1).astype(np.int32)
        counts = jax.jit(count_samples)(counts, t, tokens)
        histories = [(prompt, [*output, int(token)]) for (prompt, output), token in zip(histories, tokens)]
