"""Request: the known-token array that a penalised request's sampling history is read from."""

import numpy as np
import pytest

from jaxserve.engine.request import Request
from jaxserve.sampling_params import SamplingParams


def test_the_known_token_array_follows_the_lists_through_growth_and_dropped_outputs():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, 50).tolist()
    request = Request("r", list(prompt), SamplingParams(max_tokens=500, ignore_eos=True), 0, 1000)
    kept = []
    for i in range(150):   # the buffer grows past 64 and 128 tokens
        if i % 7 == 0:
            kept.append((request.known_token_array(), prompt + request.output_token_ids))
        request.append_token(int(rng.integers(0, 1000)))
        if i % 3 == 0:
            np.testing.assert_array_equal(request.known_token_array(), prompt + request.output_token_ids)
    for view, tokens in kept:   # a view handed to an earlier step still holds that step's tokens
        np.testing.assert_array_equal(view, tokens)
    view = request.known_token_array()
    assert view.dtype == np.int32 and not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 1
    request.drop_last_outputs(20)   # a stop string ended it 20 tokens earlier
    assert len(request.output_token_ids) == 130
    np.testing.assert_array_equal(request.known_token_array(), prompt + request.output_token_ids)
    request.output_token_ids.append(999)   # were it to go on, the dropped places are refilled
    np.testing.assert_array_equal(request.known_token_array(), prompt + request.output_token_ids)
