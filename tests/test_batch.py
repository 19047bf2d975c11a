"""The step layout: decodes laid out a column at a time give exactly the row-by-row layout, the
ragged rows included."""

import jax
import numpy as np
import pytest

from jaxserve.engine import batch
from jaxserve.engine.batch import BatchLayout, Bucket
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.sampling_params import SamplingParams

PAGE, SEGMENT, VOCAB = 4, 8, 64


def random_step(rng, num_slices: int):
    """Decodes (placeholders or not, sampling or not) and prompt chunks (some scoring their prompt),
    interleaved, over `num_slices` slices, with LoRA slots and the step before's rows."""
    sequences, previous, lora = [], {}, {}
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=3),
              SamplingParams(temperature=0, repetition_penalty=1.2, logit_bias={3: 1.0})]
    for i in range(int(rng.integers(1, 12))):
        tokens = 1 if rng.random() < 0.7 else int(rng.integers(2, 20))
        start = int(rng.integers(0, 40))
        table = tuple(int(p) for p in rng.integers(1, 100, -(-(start + tokens) // PAGE)))
        decode = tokens == 1
        placeholder = decode and rng.random() < 0.5
        targets = tuple(int(t) for t in rng.integers(0, VOCAB, min(tokens, 3))) if not decode and rng.random() < 0.5 \
            else ()
        sequences.append(ScheduledSequence(
            f"r{i}", tuple(int(t) for t in rng.integers(0, VOCAB, tokens)), start, table,
            bool(rng.random() < 0.8), params[i % 3], seed=i, num_output_tokens=i % 4,
            history=(1, 2, 5), num_prompt_tokens=2, data_slice=int(rng.integers(0, num_slices)),
            prompt_targets=targets, placeholder=placeholder))
        if placeholder:
            previous[f"r{i}"] = int(rng.integers(0, 8))
        if rng.random() < 0.5:
            lora[f"r{i}"] = int(rng.integers(1, 3))
    return SchedulerOutput(tuple(sequences), lora_slots=lora), previous


@pytest.mark.parametrize("seed", range(12))
def test_decodes_by_columns_equal_the_row_by_row_layout(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    num_slices = 1 + seed % 2
    layout = BatchLayout(PAGE, SEGMENT, 2, 16, VOCAB, 64)
    output, previous = random_step(rng, num_slices)
    bucket = layout.needs(output, num_slices)
    # padding too, and every third step in slots of 3 tokens, as beside another slice's drafts
    bucket = Bucket(bucket.num_decode + 1, bucket.num_segments + 1, 3 if seed % 3 == 0 else bucket.decode_len)
    fast, fast_rows = layout.build(output, bucket, num_slices, previous)
    monkeypatch.setattr(batch, "_single_tokens", lambda decodes: False)
    slow, slow_rows = layout.build(output, bucket, num_slices, previous)
    assert fast_rows == slow_rows
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fast), jax.tree.leaves(slow)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_a_placeholder_the_step_before_did_not_sample_is_named():
    layout = BatchLayout(PAGE, SEGMENT, 2, 16, VOCAB, 64)
    s = ScheduledSequence("r0", (1,), 5, (1, 2), True, SamplingParams(), 0, 0, placeholder=True)
    with pytest.raises(ValueError, match="r0 has a placeholder, but the step before did not sample it"):
        layout.build(SchedulerOutput((s,)), Bucket(1, 0, 1))


def test_logit_rows_are_a_power_of_two_and_at_most_max_num_seqs_worth():
    """Buckets with as many logit rows share a sampling program; a mixed bucket's decode slots and
    segments outnumber the sequences a step holds, so its rows stop at max_num_seqs decodes'."""
    capped = BatchLayout(PAGE, SEGMENT, 2, 16, VOCAB, 64, max_num_seqs=8)
    uncapped = BatchLayout(PAGE, SEGMENT, 2, 16, VOCAB, 64)
    buckets = [Bucket(1, 0), Bucket(3, 0), Bucket(8, 1), Bucket(8, 4), Bucket(2, 1, decode_len=3)]
    assert [uncapped.num_logit_rows(b) for b in buckets] == [1, 4, 16, 16, 8]
    assert [capped.num_logit_rows(b) for b in buckets] == [1, 4, 8, 8, 8]
    # 6 decodes, then 2 sampling prompt chunks: their rows follow the decodes', not the 8 slots
    sequences = tuple(ScheduledSequence(f"d{i}", (1,), 5, (1, 2), True, SamplingParams(), 0, 0) for i in range(6)) \
        + tuple(ScheduledSequence(f"p{i}", (1, 2, 3), 0, (3 + i,), True, SamplingParams(), 0, 0) for i in range(3))
    _, rows = capped.build(SchedulerOutput(sequences[:8]), Bucket(8, 2))
    assert [s.request_id for s in rows] == [s.request_id for s in sequences[:8]]
    with pytest.raises(ValueError, match=r"a step of 6 decodes and 3 prompt chunks exceeds the 8 logit rows"):
        capped.build(SchedulerOutput(sequences), Bucket(8, 3))
