"""LLMEngine on a tiny random model: requests in, tokens out, bad input refused, pages returned."""

import jax
import pytest

from jaxserve.checkpoint.loader import load_model
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams

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
    return engine.allocator.num_free_pages == engine.allocator.num_usable_pages


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

    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
