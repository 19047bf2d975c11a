"""The runner's compiled shapes: few of them, and every step the scheduler can make fits one."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.batch import Bucket
from jaxserve.engine.runner import smallest_bucket, step_buckets


def test_default_settings_compile_at_most_twelve_programs():
    buckets = step_buckets(32, 512, 16)   # EngineConfig's max_num_seqs, budget and prefill_segment
    assert len(buckets) <= 12
    assert buckets[0] == Bucket(1, 0) and buckets[-1] == Bucket(32, 32)


def test_decode_only_steps_get_no_padded_segments():
    buckets = step_buckets(64, 512, 16)
    assert [smallest_bucket(buckets, Bucket(d, 0)) for d in (1, 3, 33, 64)] == [
        Bucket(1, 0), Bucket(4, 0), Bucket(64, 0), Bucket(64, 0)]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.sampled_from([1, 8, 16, 32]), st.integers(1, 4096), st.data())
def test_every_schedulable_step_fits_a_small_enough_bucket(max_num_seqs, segment, budget, data):
    budget = max(budget, segment)   # EngineConfig: max_num_batched_tokens >= prefill_segment
    buckets = step_buckets(max_num_seqs, budget, segment)
    # The scheduler: at most max_num_seqs sequences; decodes cost a token, chunks whole segments.
    segments = data.draw(st.integers(0, budget // segment))
    decodes = data.draw(st.integers(0, min(max_num_seqs - (segments > 0), budget - segments * segment)))
    if decodes == segments == 0:
        decodes = 1
    bucket = smallest_bucket(buckets, Bucket(decodes, segments))
    assert bucket.num_decode >= decodes and bucket.num_segments >= segments
    # Padding: at most about twice the real tokens, plus the decode slots.
    real = decodes + segments * segment
    assert bucket.num_tokens(segment) <= 2 * real + max_num_seqs + segment
    assert len(buckets) <= 2 * (max_num_seqs.bit_length() + (budget // segment).bit_length())


def test_a_step_too_big_for_every_bucket_is_named():
    with pytest.raises(ValueError, match="exceeds the largest compiled bucket"):
        smallest_bucket(step_buckets(4, 64, 16), Bucket(5, 0))
