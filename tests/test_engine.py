"""LLMEngine on a tiny random model: requests in, tokens out, bad input refused, pages returned."""

import contextlib
import dataclasses
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.checkpoint.loader import load_model
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.sampler import PROMPT_TOKEN
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from conftest import recorded_slots

CONFIG = dict(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load_model(str(tiny_models("llama")[0]), "float32")


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(EngineConfig(**CONFIG), model=tiny)


def drain(engine):
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def generate(engine, prompt, params):
    request_id = engine.add_request(prompt, params)
    return drain(engine)[request_id].outputs


def pool_is_full(engine):
    return engine.stats().kv_cache_usage == 0


def test_varied_workload_compiles_nothing_after_warm_up(engine):
    compiles = []
    listener = lambda event, *args, **kwargs: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i, prompt_len in enumerate([1, 3, 17, 64, 100, 40, 5, 9, 33, 2]):
            engine.add_request(list(range(10, 10 + prompt_len)),
                               SamplingParams(temperature=0.5 * (i % 3), top_p=0.9 if i % 2 else 1.0,
                                              top_k=5 * (i % 4), max_tokens=1 + i * 2, ignore_eos=True))
            engine.step()
        drain(engine)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert pool_is_full(engine)


def test_compiling_in_the_background_serves_at_once_with_the_same_tokens(engine, tiny):
    """Ready once the largest bucket (every step fits it) and the smallest compile; requests run
    meanwhile, padded into a compiled bucket, and get the tokens of an engine that compiled all
    first. Once the rest are compiled, steps take them and compile nothing more."""
    background = LLMEngine(EngineConfig(**CONFIG, compile_in_background=True), model=tiny)
    runner = background.runner
    ready = runner.ready_buckets
    assert ready[0] == runner.buckets[0] and ready[-1] == runner.buckets[-1] and len(ready) < len(runner.buckets)
    prompts = [list(range(10, 10 + n)) for n in (1, 9, 40, 100)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for which in (background, engine):
        ids = [which.add_request(p, params) for p in prompts]
        done = drain(which)
        tokens[which] = [done[i].outputs[0].token_ids for i in ids]
    assert tokens[background] == tokens[engine]
    runner.wait_compiled()
    assert runner.ready_buckets == runner.buckets
    test_varied_workload_compiles_nothing_after_warm_up(background)


@contextlib.contextmanager
def step_programs(lowered: list):
    """Appends the name of each step program lowered (to compile, or to find it in the compile
    cache) within the block: jit(logits_step) (a bucket's model) or jit(sample_step)."""
    def listener(event, *args, fun_name=None, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and fun_name in (
                "jit(logits_step)", "jit(sample_step)"):
            lowered.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_buckets_with_as_many_logit_rows_share_one_sampling_program(tiny):
    """The warm-up lowers a model program per bucket and a sampling program per number of logit
    rows (a power of two), fewer than the buckets."""
    with step_programs([]) as warmed:
        warmed_engine = LLMEngine(EngineConfig(**CONFIG), model=tiny)
    buckets, layout = warmed_engine.runner.buckets, warmed_engine.runner.layout
    sizes = {layout.num_logit_rows(b) for b in buckets}
    assert warmed.count("jit(logits_step)") == len(buckets)
    assert warmed.count("jit(sample_step)") == len(sizes) < len(buckets)
    assert all(n & (n - 1) == 0 for n in sizes)


def test_enforce_eager_compiles_only_the_step_shapes_its_steps_take(engine, tiny):
    """No step compiled at start-up; each shape compiled by the first step that takes it, and the
    tokens those of an engine that compiled every shape first."""
    with step_programs([]) as at_start:
        eager = LLMEngine(EngineConfig(**CONFIG, enforce_eager=True), model=tiny)
    assert at_start == []
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def tokens(which):
        ids = [which.add_request(list(range(10, 10 + n)), params) for n in (3, 9)]
        done = drain(which)
        return [done[i].outputs[0].token_ids for i in ids]

    with step_programs([]) as by_steps:
        eager_tokens = tokens(eager)
    # one prefill step of both prompts, then decodes of both rows: two buckets, each with a number
    # of logit rows of its own
    assert by_steps == ["jit(logits_step)", "jit(sample_step)"] * 2
    assert eager_tokens == tokens(engine)
    assert pool_is_full(eager)


def test_outputs_have_the_requested_lengths_and_text(engine):
    ids = [engine.add_request("Hello there, how are you", SamplingParams(temperature=0, max_tokens=n,
                                                                          ignore_eos=True)) for n in (1, 5, 12)]
    done = drain(engine)
    for request_id, n in zip(ids, (1, 5, 12)):
        sample = done[request_id].outputs[0]
        assert len(sample.token_ids) == n and sample.finish_reason == "length"
        assert sample.text == engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)


def test_n_samples_and_seeds(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    outputs_a = generate(engine, [5, 6, 7], params)
    outputs_b = generate(engine, [5, 6, 7], params)
    assert [o.token_ids for o in outputs_a] == [o.token_ids for o in outputs_b]
    assert len({tuple(o.token_ids) for o in outputs_a}) > 1      # the samples differ from each other
    assert [o.index for o in outputs_a] == [0, 1, 2]


def test_stop_token_ids_and_stop_strings(engine):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = generate(engine, [3, 4, 5], greedy)[0]
    stop_id = reference.token_ids[3]
    out = generate(engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == reference.token_ids[:reference.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop"
    stop_text = reference.text[len(reference.text) // 2:][:3]
    out = generate(engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=10, stop=[stop_text]))[0]
    assert out.finish_reason == "stop" and out.text == reference.text[:reference.text.index(stop_text)]


def test_output_kinds_carry_the_same_request(engine):
    """CUMULATIVE, DELTA and FINAL_ONLY (vLLM's RequestOutputKind) of one request, run side by side:
    the deltas add up to the cumulative outputs, and the final-only request has one output."""
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    reference = generate(engine, [3, 4, 5, 6], params)
    params = dataclasses.replace(params, stop=[reference[0].text[len(reference[0].text) // 2:][:2]])
    kinds = list(RequestOutputKind)
    ids = [engine.add_request([3, 4, 5, 6], dataclasses.replace(params, output_kind=kind)) for kind in kinds]
    seen = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    cumulative, delta, final = (seen[i] for i in ids)
    assert len(final) == 1 and final[0].outputs == cumulative[-1].outputs
    assert len(delta) == len(cumulative) > 2 and [o.finished for o in delta] == [o.finished for o in cumulative]
    assert delta[0].prompt_logprobs == cumulative[0].prompt_logprobs and all(o.prompt_logprobs is None
                                                                             for o in delta[1:])
    assert any(o.finish_reason == "stop" for o in cumulative[-1].outputs)
    for i, want in enumerate(cumulative[-1].outputs):
        parts = [o.outputs[i] for o in delta]
        assert "".join(p.text for p in parts) == want.text
        assert [t for p in parts for t in p.token_ids] == want.token_ids
        assert [lp for p in parts for lp in p.logprobs] == want.logprobs
        assert parts[-1].finish_reason == want.finish_reason
        assert parts[-1].cumulative_logprob == want.cumulative_logprob
    for outputs in (cumulative, delta, final):   # the times of its arrival, admission and first token
        (times,) = {o.metrics for o in outputs}
        assert times.arrival_time <= times.first_scheduled_time <= times.first_token_time


def test_abort_returns_every_page(engine):
    ids = [engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
           for _ in range(3)]
    engine.step()
    engine.step()
    for request_id in ids:
        assert engine.abort(request_id).outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and pool_is_full(engine)


@pytest.mark.parametrize("prompt, params, param, message", [
    ([1] * 128, SamplingParams(), "prompt", "128 tokens, but max_model_len is 128"),
    ([1] * 100, SamplingParams(max_tokens=40), "max_tokens", "exceeds max_model_len=128"),
    ("", SamplingParams(), "prompt", "empty"),
    ([], SamplingParams(), "prompt", "empty"),
    ([49152], SamplingParams(), "prompt", "outside the vocabulary"),
])
def test_bad_requests_are_refused_and_allocate_nothing(engine, prompt, params, param, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        engine.add_request(prompt, params)
    assert error.value.param == param
    assert not engine.has_unfinished_requests() and pool_is_full(engine)


@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 0, ">= 1"), ("temperature", -0.1, ">= 0"), ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"), ("top_k", -2, "-1"), ("min_p", 2.0, "[0, 1]"), ("n", 0, ">= 1"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3.0, "[-2, 2]"),
    ("repetition_penalty", 0.0, "(0, 2]"), ("logprobs", 21, "[0, 20]"), ("best_of", 0, ">= n=1"),
    ("min_tokens", -1, ">= 0"),
])
def test_bad_sampling_params_name_value_and_range(field, value, allowed):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field and f"{field}={value!r}" in str(error.value)
    assert allowed in str(error.value)


def test_pool_too_small_for_one_sequence_fails_at_start_up(tiny):
    with pytest.raises(ValueError, match=r"num_pages=10 holds 72 tokens.*max_model_len=128 needs 16 pages"):
        LLMEngine(EngineConfig(**{**CONFIG, "num_pages": 10}), model=tiny)


def test_unknown_architecture_lists_the_supported_ones():
    from jaxserve.config import ModelConfig

    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: Gemma2ForCausalLM, .*LlamaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_bad_logit_bias_and_too_many_samples_are_named(engine):
    for params, param, message in [
            (SamplingParams(logit_bias={49152: 1.0}), "logit_bias", "token id 49152 in logit_bias is outside"),
            (SamplingParams(n=9), "n", "n=9 exceeds max_num_seqs=8"),
            (SamplingParams(n=2, best_of=9), "best_of", "best_of=9 exceeds max_num_seqs=8")]:
        with pytest.raises(InvalidRequestError, match=message) as error:
            engine.add_request([1, 2, 3], params)
        assert error.value.param == param
    with pytest.raises(InvalidRequestError, match=r"biases must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101.0})
    assert not engine.has_unfinished_requests() and pool_is_full(engine)


def test_logit_bias_and_min_tokens_steer_greedy_decoding(engine):
    favourite = 1234
    out = generate(engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=4, logit_bias={favourite: 100}))[0]
    assert out.token_ids == [favourite] * 4
    # The favourite is also a stop id: suppressed for the first 3 tokens, then it stops the request.
    out = generate(engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=8, logit_bias={favourite: 100},
                                                     stop_token_ids=[favourite], min_tokens=3))[0]
    assert len(out.token_ids) == 4 and favourite not in out.token_ids[:3]
    assert out.token_ids[3] == favourite and out.finish_reason == "stop"


def test_frequency_and_presence_penalties_vary_greedy_output(engine):
    plain = generate(engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(set(plain.token_ids)) < len(plain.token_ids)          # the random model repeats itself
    penalized = generate(engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                           frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))


def test_logprobs_equal_log_softmax_of_transformers_logits(engine, tiny_models):
    import torch

    prompt = [11, 22, 33, 44, 55, 66, 77]
    out = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5))[0]
    with torch.no_grad():
        logits = tiny_models("llama")[1](torch.tensor([prompt + out.token_ids])).logits[0].double()
    reference = torch.log_softmax(logits, -1).numpy()[len(prompt) - 1:-1]
    assert len(out.logprobs) == 6
    for position, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[position] and len(lp.top) == 5
        assert abs(lp.logprob - reference[position, lp.token_id]) < 1e-4
        assert [t for t, _ in lp.top] == np.argsort(-reference[position])[:5].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(reference[position])[::-1][:5], atol=1e-4)
    assert abs(out.cumulative_logprob - sum(lp.logprob for lp in out.logprobs)) < 1e-6


def test_best_of_returns_the_most_likely_samples(engine):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    request_id = engine.add_request([9, 8, 7], params)
    finished = drain(engine)[request_id]
    everyone = generate(engine, [9, 8, 7], SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=5,
                                                          ignore_eos=True, logprobs=0))
    best = sorted(everyone, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in finished.outputs] == [o.token_ids for o in best]
    assert [o.index for o in finished.outputs] == [0, 1] and pool_is_full(engine)


def test_step_observer_is_told_where_each_step_went(engine):
    times = []
    engine.step_observer = times.append
    try:
        engine.add_request(list(range(1000, 1040)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        started = time.perf_counter()
        drain(engine)
        wall = time.perf_counter() - started
    finally:
        engine.step_observer = None
    # A 40-token prompt (no other test's prefix) in one step under the 64-token budget, then decodes.
    assert [t.kind for t in times] == ["prefill", "decode", "decode", "decode"]
    assert [t.num_tokens for t in times] == [40, 1, 1, 1]
    for t in times:
        assert min(t.schedule, t.prepare, t.launch, t.update, t.outputs) >= 0 and t.device > 0
    # The parts are disjoint slices of the loop's wall time.
    assert sum(t.host + t.device for t in times) <= wall


def test_non_finite_logits_fail_only_their_request(engine, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = generate(engine, "a neighbour", greedy)[0].token_ids
    sample_step = engine.runner._sample_step

    def poisoned(logits, last_tokens, sampled, sampling):   # rows sampled at temperature 0.5 get NaN logits
        samples, sampled = sample_step(logits, last_tokens, sampled, sampling)
        return samples.replace(finite=samples.finite & (sampling.temperature != 0.5)), sampled

    monkeypatch.setattr(engine.runner, "_sample_step", poisoned)
    victim = engine.add_request("the victim", SamplingParams(temperature=0.5, seed=1, max_tokens=6, n=2))
    neighbour = engine.add_request("a neighbour", greedy)
    finished = drain(engine)
    assert "logits were not finite" in finished[victim].error
    assert finished[neighbour].error is None and finished[neighbour].outputs[0].token_ids == alone
    assert pool_is_full(engine)
    monkeypatch.setattr(engine.runner, "_sample_step", sample_step)
    assert len(generate(engine, "the victim", SamplingParams(temperature=0.5, seed=1, max_tokens=6))[0].token_ids) == 6


def test_a_tokenizer_failing_on_one_request_fails_only_it(engine, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = generate(engine, "a neighbour", greedy)[0].token_ids
    cursed = next(t for t in range(5, 100) if t not in alone)
    decode = engine.tokenizer.decode

    def fussy(ids, **kwargs):
        if cursed in ids:
            raise ValueError(f"cannot decode {cursed}")
        return decode(ids, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "decode", fussy)
    victim = engine.add_request("the victim", SamplingParams(temperature=0, max_tokens=6, logit_bias={cursed: 100}))
    neighbour = engine.add_request("a neighbour", greedy)
    finished = drain(engine)
    assert f"making the output failed: ValueError: cannot decode {cursed}" in finished[victim].error
    assert finished[neighbour].error is None and finished[neighbour].outputs[0].token_ids == alone
    assert pool_is_full(engine)


def test_more_stop_strings_than_allowed_are_refused():
    with pytest.raises(InvalidRequestError, match="stop='17 strings' is out of range: at most 16 stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(17)])


# ---- async scheduling: step N+1 scheduled and launched before step N is read back ----------------

@contextlib.contextmanager
def serial(engine):
    """The same engine with async scheduling off, inside the block."""
    config = engine.config
    engine.config = dataclasses.replace(config, async_scheduling=False)
    try:
        yield
    finally:
        engine.config = config


def run_streams(engine, requests, abort_at=None):
    """Runs (prompt, params) requests together; every output seen, by request. `abort_at`: request
    index -> the step after which it is aborted."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    seen = {i: [] for i in ids}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        step += 1
        for index, when in (abort_at or {}).items():
            if when == step and engine.abort(ids[index]) is not None:
                seen[ids[index]].append(None)
    return [seen[i] for i in ids]


def final_tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs if o is not None][-1] if any(outputs) else []


def test_next_step_is_scheduled_before_the_last_is_read_back(engine, monkeypatch):
    """A device slowed down by 50 ms a step: each step's schedule runs before the step before is
    read back, so the host's work overlaps the device's; with async scheduling off it does not."""
    events = []
    schedule, collect = engine.scheduler.schedule, engine.runner.collect

    def scheduling():
        output = schedule()
        if not output.is_empty:
            events.append("schedule")
        return output

    def slow_collect(step):
        time.sleep(0.05)   # the device still busy with it
        events.append("read back")
        return collect(step)

    engine.step()   # reads back a step an earlier test left in flight, if any
    monkeypatch.setattr(engine.scheduler, "schedule", scheduling)
    monkeypatch.setattr(engine.runner, "collect", slow_collect)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    generate(engine, [5, 6, 7], params)
    assert events[:4] == ["schedule", "schedule", "read back", "schedule"]
    assert events.count("schedule") == events.count("read back") == 6
    events.clear()
    with serial(engine):
        generate(engine, [5, 6, 7], params)
    assert events == ["schedule", "read back"] * 6
    assert pool_is_full(engine)


STOPS = [dict(max_tokens=36), dict(stop_at_token=25), dict(stop_at_text=80), dict(min_tokens=30, stop_at_token=2),
         dict(max_tokens=33, n=2, seed=4, temperature=0.8)]


def test_stops_aborts_and_preemption_under_async_scheduling_equal_serial_steps(engine):
    """EOS-like stop ids, stop strings, max_tokens, min_tokens, n > 1, an abort and preemption (10
    requests of up to 88 tokens on a pool of 376): the same tokens and text as serial steps, never
    a token past the stop in any streamed output, and every page back in the pool."""
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(10)]
    plain = [generate(engine, p, base)[0] for p in prompts[:len(STOPS)]]

    def params(i):
        spec = dict(STOPS[i % len(STOPS)])
        stop_token, stop_text = spec.pop("stop_at_token", None), spec.pop("stop_at_text", None)
        if stop_token is not None:
            spec["stop_token_ids"] = [plain[i % len(STOPS)].token_ids[stop_token]]
        if stop_text is not None:
            spec["stop"] = [plain[i % len(STOPS)].text[stop_text:stop_text + 3]]
        return dataclasses.replace(base, **spec)

    requests = [(p, params(i)) for i, p in enumerate(prompts)]
    preemptions = engine.stats().num_preemptions
    overlapped = run_streams(engine, requests, abort_at={7: 6})
    assert engine.stats().num_preemptions > preemptions
    assert pool_is_full(engine)
    with serial(engine):
        stepped = run_streams(engine, requests, abort_at={7: 6})
    assert pool_is_full(engine)
    for i, (a, b) in enumerate(zip(overlapped, stepped)):
        if i == 7:   # aborted: what it got is a prefix of what it would have made
            continue
        assert [(c.token_ids, c.text, c.finish_reason) for c in a[-1].outputs] == \
               [(c.token_ids, c.text, c.finish_reason) for c in b[-1].outputs]
        final = a[-1].outputs
        for streamed in a:
            for c, last in zip(streamed.outputs, final):
                assert last.token_ids[:len(c.token_ids)] == c.token_ids and last.text.startswith(c.text)
    whole = generate(engine, *requests[7])[0].token_ids
    for aborted in (overlapped[7], stepped[7]):
        assert aborted[-1] is None and final_tokens(aborted) == whole[:len(final_tokens(aborted))]


def test_penalised_requests_are_scheduled_ahead_with_the_same_tokens(engine, monkeypatch):
    """A penalised request's last token is counted on the device (sampler.PLACEHOLDER): steps are
    scheduled ahead while it runs, and its tokens and its neighbour's equal serial steps'."""
    ahead = []
    schedules_ahead = engine._schedules_ahead
    monkeypatch.setattr(engine, "_schedules_ahead", lambda: ahead.append(schedules_ahead()) or ahead[-1])
    requests = [([3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 repetition_penalty=1.3, frequency_penalty=0.5)),
                ([2, 7, 1, 8], SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True,
                                              presence_penalty=1.5)),
                ([2, 7, 1, 8], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    overlapped = [final_tokens(o) for o in run_streams(engine, requests)]
    assert ahead and all(ahead[:9])
    with serial(engine):
        assert [final_tokens(o) for o in run_streams(engine, requests)] == overlapped
    unpenalised = [final_tokens(o) for o in run_streams(engine, [(p, dataclasses.replace(
        params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)) for p, params in requests])]
    assert unpenalised[0] != overlapped[0]   # the penalties changed its tokens (it repeats some)


WORDS = StructuredOutputsParams(regex="[a-z]+( [a-z]+)*")   # a constraint whose masks vary token by token


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 14), st.integers(0, 5), st.integers(0, 12),
                          st.booleans()), min_size=1, max_size=6))
def test_random_arrivals_aborts_and_lengths_give_each_request_its_own_tokens(engine, specs):
    """Requests (prompt length, max_tokens, arrival step, abort step or 0, constrained) through the
    async loop: each gets the tokens it gets alone in serial steps; an aborted one, a prefix of them.
    Constrained ones (a regex) make steps that run to their logits before their masks come."""
    def params(max_tokens, constrained):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              structured_outputs=WORDS if constrained else None)

    alone = {}
    with serial(engine):
        for length, max_tokens, _, _, constrained in specs:
            if (length, max_tokens, constrained) not in alone:
                prompt = list(range(50 + length, 50 + 2 * length))
                alone[length, max_tokens, constrained] = generate(engine, prompt, params(
                    max_tokens, constrained))[0].token_ids
    ids, got, step = {}, {}, 0
    while len(ids) < len(specs) or engine.has_unfinished_requests():
        for i, (length, max_tokens, arrival, abort, constrained) in enumerate(specs):
            if arrival == step:
                ids[i] = engine.add_request(list(range(50 + length, 50 + 2 * length)), params(max_tokens, constrained))
            if abort and abort == step and i in ids:
                engine.abort(ids[i])
        for out in engine.step():
            got[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert pool_is_full(engine)
    for i, (length, max_tokens, arrival, abort, constrained) in enumerate(specs):
        expected, tokens = alone[length, max_tokens, constrained], got.get(ids[i], [])
        if abort and abort >= arrival:
            assert tokens == expected[:len(tokens)]
        else:
            assert tokens == expected


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_windowed_model_returns_pages_behind_the_window_and_keeps_transformers_tokens(tiny_models, backend):
    """Mistral with a window of 12 on pages of 4, prompts several windows long in steps of 8: the
    greedy tokens are transformers' own, although the requests' whole contexts (over 40 pages) would
    not fit the pool's 23 pages together. Each holds at most the pages its window and its chunk
    reach, nobody is preempted, and every page is back in the pool at the end."""
    import torch

    directory, hf_model = tiny_models("mistral_window")
    model = load_model(str(directory), "float32")
    engine = LLMEngine(EngineConfig(num_pages=24, page_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                                    prefill_segment=8, max_model_len=128, attention_backend=backend), model=model)
    assert engine.scheduler.slices[0].config.sliding_window == 12
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (45, 30, 7, 15)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # The last has two samples: the second forks from the first's prompt pages once the first's
    # decode is scheduled, and recomputes token 14, whose window reaches back to position 3.
    ids = [engine.add_request(p, dataclasses.replace(params, n=2) if len(p) == 15 else params) for p in prompts]
    allocator, finished, most_held = engine.allocators[0], {}, 0
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        for table in allocator._tables.values():
            most_held = max(most_held, sum(1 for page in table if page))
    assert most_held <= 6    # 12 keys before a chunk's first query, a chunk of 8, from a page's middle: 6 pages
    assert engine.stats().num_preemptions == 0 and pool_is_full(engine)
    for request_id, prompt in zip(ids, prompts):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                          do_sample=False)[0, len(prompt):].tolist()
        assert [o.token_ids for o in finished[request_id].outputs] == [reference] * len(finished[request_id].outputs)


def test_repetition_penalty_keeps_transformers_tokens(engine, tiny_models):
    """A penalised request's history (prompt then outputs) is extended in place step by step
    (Request.known_token_array), past its buffer's first 64 tokens: greedy tokens are transformers'
    own under its RepetitionPenaltyLogitsProcessor, which also counts the prompt."""
    import torch

    hf_model = tiny_models("llama")[1]
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.5)
    penalized = generate(engine, prompt, params)[0].token_ids
    with torch.no_grad():
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                      repetition_penalty=1.5)[0, len(prompt):].tolist()
    assert penalized == reference
    assert penalized != generate(engine, prompt, dataclasses.replace(params, repetition_penalty=1.0))[0].token_ids


def test_penalised_sequences_send_their_history_once_and_are_counted_on_the_device(engine, monkeypatch):
    """A penalised sequence's token counts stay on the device (penalty_slots.py): its history goes
    out with the step that first samples for it, and never again while its slot is current; the
    slot then holds its outputs' counts and its prompt's tokens, and its tokens are serial steps'."""
    given = recorded_slots(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5,
                            repetition_penalty=1.3)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [9, 9, 9]]
    outputs = [o[-1] for o in run_streams(engine, [(p, params) for p in prompts])]
    counts = np.asarray(engine.runner._sampled.counts)
    for prompt, output in zip(prompts, outputs):
        rows = [found for sample_id, found in given if sample_id == f"{output.request_id}/0"]
        assert len(rows) == 12 and rows[0][1] and not any(filled for _, filled, _ in rows[1:])
        expected = np.zeros(counts.shape[1], np.int32)
        np.add.at(expected, output.outputs[0].token_ids, 1)
        expected[prompt] |= PROMPT_TOKEN
        np.testing.assert_array_equal(counts[rows[0][0]], expected)
    with serial(engine):
        assert [final_tokens(o) for o in run_streams(engine, [(p, params) for p in prompts])] == \
               [o.outputs[0].token_ids for o in outputs]


def test_preempted_penalised_sequences_refill_their_slots_and_keep_their_tokens(engine, monkeypatch):
    """Penalised requests preempted (their placeholder dropped, their slot counted one sample too
    many) or pushed out of their slot fill it again from their history: each gets the tokens it
    gets alone."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=0.4,
                            presence_penalty=0.3, repetition_penalty=1.2)
    prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(10)]
    alone = [generate(engine, p, params)[0].token_ids for p in prompts]
    given = recorded_slots(monkeypatch)
    preemptions = engine.stats().num_preemptions
    together = [final_tokens(o) for o in run_streams(engine, [(p, params) for p in prompts])]
    assert engine.stats().num_preemptions > preemptions
    assert together == alone
    assert sum(filled for _, (_, filled, _) in given) > len(prompts)   # some filled again
    assert pool_is_full(engine)
