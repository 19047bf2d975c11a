"""Speculative verification keeps the target's distribution: drafts from a different q, the real
sampler's seeded rows, and the emitted tokens' joint distribution tested against p by chi-square."""

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.engine.rejection_sampler import accepted_length
from jaxserve.engine.sampler import sample, sampling_tensors
from jaxserve.engine.scheduler_output import ScheduledSequence
from jaxserve.sampling_params import SamplingParams

VOCAB = 4
DRAWS = 20000
P1 = np.array([0.1, 0.2, 0.3, 0.4])                      # the target's first token
P2 = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1],   # its second, given the first
               [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]])
Q1 = np.array([0.4, 0.3, 0.2, 0.1])                      # a draft model that disagrees
Q2 = P2[::-1]


def draw(probs: np.ndarray, index: int, seeds: range) -> np.ndarray:
    """One token per row of `probs` [N, VOCAB] with the engine's sampler, each row seeded as output
    token `index` of a request seeded with its seed."""
    params = SamplingParams(temperature=1.0)
    rows = [ScheduledSequence(str(s), (0,), 0, (), True, params, s, index) for s in seeds]
    tensors = sampling_tensors(rows, len(rows), VOCAB, 1)
    return np.asarray(jax.jit(sample)(np.log(probs).astype(np.float32), tensors).tokens)


def kept_run(sampled, drafts):
    return sampled[:accepted_length(sampled, drafts)]


def emitted_pairs(verify) -> np.ndarray:
    """Each draw's first two output tokens: a step verifying one draft (its sample after the last
    token, and after the draft), then, if only one token was kept, a plain step for the second."""
    seeds = range(DRAWS)
    draft = draw(Q1[None].repeat(DRAWS, 0), 0, seeds)                 # q's proposal, the same seed
    first = draw(P1[None].repeat(DRAWS, 0), 0, seeds)                 # the target after the last token
    after_draft = draw(P2[draft], 1, seeds)                           # ... and after the draft
    after_first = draw(P2[first], 1, seeds)                           # a later step's sample
    pairs = []
    for i in range(DRAWS):
        run = verify([first[i], after_draft[i]], [draft[i]])
        pairs.append(run if len(run) == 2 else [run[0], after_first[i]])
    return np.array(pairs)


def chi_square_p_value(pairs: np.ndarray) -> float:
    observed = np.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    expected = (P1[:, None] * P2).reshape(-1) * len(pairs)
    return stats.chisquare(observed, expected).pvalue


def test_kept_tokens_are_distributed_as_the_target_alone_makes_them():
    pairs = emitted_pairs(kept_run)
    assert chi_square_p_value(pairs) > 1e-3
    accepted = np.mean(pairs[:, 0] == draw(Q1[None].repeat(DRAWS, 0), 0, range(DRAWS)))
    # measured 0.547; no verification can accept more than 1 - TV(p, q) = 0.6 of q's proposals
    assert 0.5 < accepted <= 0.6 + 0.01


@pytest.mark.parametrize("wrong", ["keeps every draft", "keeps samples past a rejection"])
def test_the_chi_square_test_rejects_a_wrong_sampler(wrong):
    if wrong == "keeps every draft":
        verify = lambda sampled, drafts: [drafts[0], sampled[1]]
    else:
        verify = lambda sampled, drafts: list(sampled)
    assert chi_square_p_value(emitted_pairs(verify)) < 1e-6


@pytest.mark.parametrize("sampled, drafts, kept", [
    ([5, 6, 7], [5, 6], 3), ([5, 9, 7], [5, 6], 2), ([4, 6, 7], [5, 6], 1), ([3], [], 1)])
def test_accepted_length(sampled, drafts, kept):
    assert accepted_length(sampled, drafts) == kept
