"""prompt_logprobs: scored on the device against a plain reference, and end to end against
transformers through chunked prefill and beside the prefix cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.config import EngineConfig
from jaxserve.engine.batch import BatchLayout
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.engine.prompt_logprobs import BLOCK_ROWS, reference_prompt_logprobs, score_prompt
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

PROMPT_LEN = 45   # three steps of at most 16 prompt tokens (max_num_batched_tokens), several pages


@pytest.mark.parametrize("rows, scored, vocab", [(8, 3, 64), (BLOCK_ROWS, BLOCK_ROWS, 50), (80, 41, 300)])
def test_scoring_matches_the_reference(rows, scored, vocab):
    rng = np.random.default_rng(rows)
    table = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)   # packed row -> its logits
    index = np.zeros(rows, np.int32)
    target = np.full(rows, -1, np.int32)
    index[:scored] = rng.permutation(rows)[:scored]
    target[:scored] = rng.integers(0, vocab, scored)
    got = jax.jit(lambda i, t: score_prompt(lambda r: table[r], i, t))(index, target)
    want = reference_prompt_logprobs(table[index[:scored]], jnp.asarray(target[:scored]))
    np.testing.assert_allclose(got.logprob[:scored], want.logprob, atol=1e-5)
    np.testing.assert_array_equal(got.rank[:scored], want.rank)
    np.testing.assert_array_equal(got.top_ids[:scored], want.top_ids)
    np.testing.assert_allclose(got.top_logprobs[:scored], want.top_logprobs, atol=1e-5)
    assert got.top_ids.shape == (rows, MAX_LOGPROBS)


@pytest.fixture(scope="module")
def engine(tiny_models):
    directory, _ = tiny_models("llama")
    return LLMEngine(EngineConfig(model=str(directory), num_pages=64, page_size=8, max_num_seqs=2,
                                  max_num_batched_tokens=16, prefill_segment=16, max_model_len=128))


def _run(engine, prompt, params):
    request_id = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done[request_id]


def test_prompt_logprobs_match_transformers_through_chunked_prefill(engine, tiny_models):
    _, hf_model = tiny_models("llama")
    prompt = np.random.default_rng(3).integers(0, engine.model.config.vocab_size, PROMPT_LEN).tolist()
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], -1).numpy()
    output = _run(engine, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    entries = output.prompt_logprobs
    assert len(entries) == PROMPT_LEN and entries[0] is None
    for position, entry in enumerate(entries[1:]):   # entry i predicts prompt token i + 1
        row = reference[position]
        assert entry.token_id == prompt[position + 1]
        assert entry.logprob == pytest.approx(row[entry.token_id], abs=1e-4)
        # ranks and the top 3 as transformers orders them, but for tokens within float32 rounding
        assert 1 + (row > entry.logprob + 1e-4).sum() <= entry.rank <= 1 + (row > entry.logprob - 1e-4).sum()
        top_ids, top_logprobs = zip(*entry.top)
        np.testing.assert_allclose(top_logprobs, np.sort(row)[::-1][:3], atol=1e-4)
        np.testing.assert_allclose(row[list(top_ids)], top_logprobs, atol=1e-4)
    assert engine.stats().kv_cache_usage == 0


def test_a_cached_prefix_still_yields_the_prompt_logprobs(engine):
    prompt = np.random.default_rng(4).integers(0, engine.model.config.vocab_size, PROMPT_LEN).tolist()
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    cold = _run(engine, prompt, params)
    plain = _run(engine, prompt, SamplingParams(max_tokens=2, temperature=0))
    assert plain.num_cached_tokens == 40 and plain.prompt_logprobs is None   # five full pages found cached
    warm = _run(engine, prompt, params)
    assert warm.num_cached_tokens == 0, "a prompt_logprobs request computes its whole prompt"
    assert [(e.token_id, e.rank, e.top) for e in warm.prompt_logprobs[1:]] == \
        [(e.token_id, e.rank, e.top) for e in cold.prompt_logprobs[1:]]
    np.testing.assert_allclose([e.logprob for e in warm.prompt_logprobs[1:]],
                               [e.logprob for e in cold.prompt_logprobs[1:]], atol=1e-6)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_rows_name_what_build_lays_out_over_data_slices():
    layout = BatchLayout(page_size=4, segment=8, pages_per_chunk=2, table_width=8, vocab_size=100,
                         history_width=32)
    scored = SamplingParams(prompt_logprobs=1)

    def seq(name, tokens, start, data_slice, params=scored):
        targets = tuple(t + 1 for t in tokens) if params.prompt_logprobs is not None else ()
        return ScheduledSequence(name, tuple(tokens), start, (1, 2, 3, 4), True, params, 0, 0,
                                 data_slice=data_slice, prompt_targets=targets)

    output = SchedulerOutput((seq("a", [10, 11, 12], 0, 1), seq("b", [20], 5, 0, SamplingParams()),
                              seq("c", [30, 31, 32, 33, 34, 35, 36, 37, 38], 4, 0), seq("d", [40], 2, 1)))
    bucket = layout.needs(output, 2)
    batch, _ = layout.build(output, bucket, 2)
    rows = layout.prompt_rows(output, bucket, 2)
    assert [(name, position) for name, position, _ in rows] == \
        [("c", p) for p in range(4, 13)] + [("a", 0), ("a", 1), ("a", 2), ("d", 2)]
    by_row = {row: (name, position) for name, position, row in rows}
    assert sorted(by_row) == [r for r in range(len(batch.prompt_target)) if batch.prompt_target[r] >= 0]
    tokens = {s.request_id: s for s in output.sequences}
    for row, (name, position) in by_row.items():
        s = tokens[name]
        token = s.token_ids[position - s.start_position]
        assert batch.token_ids[batch.prompt_index[row]] == token and batch.prompt_target[row] == token + 1


def test_only_steps_with_prompt_rows_run_the_scoring_program(engine, monkeypatch):
    """Scoring is a program of its own (step.py): a plain request's steps never pick it, and a
    prompt_logprobs request's prefill steps always do."""
    runner, picked = engine.runner, []
    logits_step = runner._logits_step

    def recording(*args, score):
        picked.append(score)
        return logits_step(*args, score=score)

    monkeypatch.setattr(runner, "_logits_step", recording)
    prompt = list(range(3, 3 + PROMPT_LEN))
    _run(engine, prompt, SamplingParams(temperature=0, max_tokens=3))
    assert picked and not any(picked)
    picked.clear()
    _run(engine, prompt[::-1], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    assert picked == [True] * 3 + [False] * 2   # three prefill chunks of at most 16, then two decodes
