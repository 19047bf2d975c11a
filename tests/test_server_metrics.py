"""`GET /metrics`: vLLM's metric names under `jaxserve:`, and they move with requests."""

import dataclasses
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.async_engine import RequestStream
from server_fixtures import serving, tiny_engine  # noqa: F401 - fixture

NAMES = {
    "jaxserve:num_requests_running": "gauge", "jaxserve:num_requests_waiting": "gauge",
    "jaxserve:kv_cache_usage_perc": "gauge", "jaxserve:prompt_tokens": "counter",
    "jaxserve:generation_tokens": "counter", "jaxserve:request_success": "counter",
    "jaxserve:time_to_first_token_seconds": "histogram", "jaxserve:inter_token_latency_seconds": "histogram",
    "jaxserve:e2e_request_latency_seconds": "histogram", "jaxserve:num_preemptions": "counter",
    "jaxserve:prefix_cache_queries": "counter", "jaxserve:prefix_cache_hits": "counter",
    "jaxserve:request_queue_time_seconds": "histogram", "jaxserve:request_prefill_time_seconds": "histogram",
    "jaxserve:request_decode_time_seconds": "histogram", "jaxserve:request_inference_time_seconds": "histogram",
    "jaxserve:request_prompt_tokens": "histogram", "jaxserve:request_generation_tokens": "histogram",
    "jaxserve:request_params_n": "histogram", "jaxserve:request_params_max_tokens": "histogram",
    "jaxserve:iteration_tokens_total": "histogram", "jaxserve:cache_config_info": "gauge",
    "jaxserve:spec_decode_num_drafts": "counter", "jaxserve:spec_decode_num_draft_tokens": "counter",
    "jaxserve:spec_decode_num_accepted_tokens": "counter",
    "jaxserve:spec_decode_num_accepted_tokens_per_pos": "counter",
}


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine, served_model_name="metered") as server:
        yield server


def scrape(server) -> dict[tuple[str, tuple], float]:
    reply = requests.get(f"{server.url}/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "metered", **labels}.items()))), 0.0)


def test_names_and_types(server):
    reply = requests.get(f"{server.url}/metrics", timeout=10)
    families = {f.name: f.type for f in text_string_to_metric_families(reply.text)}
    assert {name: families.get(name) for name in NAMES} == NAMES


def test_counters_and_histograms_move(server, tiny_engine):
    before = scrape(server)
    prompt_len = len(tiny_engine.tokenizer.encode("Count me", add_special_tokens=False))
    body = {"prompt": "Count me", "n": 2, "max_tokens": 5, "temperature": 0}
    assert requests.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    after = scrape(server)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("jaxserve:prompt_tokens_total") == prompt_len
    assert moved("jaxserve:generation_tokens_total") == 10
    assert moved("jaxserve:request_success_total", finished_reason="length") == 2
    assert moved("jaxserve:time_to_first_token_seconds_count") == 1
    assert moved("jaxserve:e2e_request_latency_seconds_count") == 1
    # 7 steps, 6 gaps: the first sample prefills the prompt; the second forks from its pages when
    # that step is read back, after the next step was launched (async scheduling), so it samples
    # its first token two steps later (see "Parallel samples" in README).
    assert moved("jaxserve:inter_token_latency_seconds_count") == 6
    assert moved("jaxserve:e2e_request_latency_seconds_sum") > 0
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(f"jaxserve:request_{phase}_time_seconds_count") == 1
    assert moved("jaxserve:request_prefill_time_seconds_sum") > 0
    assert moved("jaxserve:request_prompt_tokens_sum") == prompt_len
    assert moved("jaxserve:request_generation_tokens_sum") == 10
    assert (moved("jaxserve:request_params_n_sum"), moved("jaxserve:request_params_max_tokens_sum")) == (2, 5)
    # Tokens computed: the prompt, then sample 0's 4 decodes, sample 1's recomputed last prompt
    # token and its 4 decodes, over the 7 steps.
    assert moved("jaxserve:iteration_tokens_total_count") == 7
    assert moved("jaxserve:iteration_tokens_total_sum") == prompt_len + 9


def test_a_reply_sent_whole_has_one_output_and_its_steps_are_still_measured(server, monkeypatch):
    """A reply sent whole asks for the final output only (no output built at each step); the
    engine's progress_observer still gives the metrics each step, as a stream's outputs do."""
    outputs = []
    put = RequestStream.put
    monkeypatch.setattr(RequestStream, "put", lambda stream, output, when: (outputs.append(output.finished),
                                                                             put(stream, output, when)))
    for stream in (False, True):
        outputs.clear()
        before = scrape(server)
        body = {"prompt": "Count me", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream}
        reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200
        after = scrape(server)
        assert outputs == ([False] * 4 if stream else []) + [True]
        moved = {name: value(after, f"jaxserve:{name}") - value(before, f"jaxserve:{name}") for name in (
            "generation_tokens_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
            "request_generation_tokens_sum")}
        assert moved == {"generation_tokens_total": 5, "time_to_first_token_seconds_count": 1,
                         "inter_token_latency_seconds_count": 4, "request_generation_tokens_sum": 5}


def test_cache_config_info(server, tiny_engine):
    labels = {"block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True",
              "num_gpu_blocks": str(tiny_engine.allocators[0].num_usable_pages), "num_cpu_blocks": "0"}
    assert scrape(server).get(("jaxserve:cache_config_info", tuple(sorted(labels.items())))) == 1


def test_gauges_follow_the_running_batch(server, tiny_engine, monkeypatch):
    execute = tiny_engine.runner.launch
    monkeypatch.setattr(tiny_engine.runner, "launch", lambda output, *rest: (time.sleep(0.02), execute(output, *rest))[1])
    body = {"prompt": "Busy", "n": 3, "max_tokens": 60, "ignore_eos": True}
    request = threading.Thread(target=requests.post, args=(f"{server.url}/v1/completions",),
                               kwargs=dict(json=body, timeout=60))
    request.start()
    deadline = time.monotonic() + 10
    while value(during := scrape(server), "jaxserve:num_requests_running") != 3:
        assert time.monotonic() < deadline, "the request never showed as running"
        time.sleep(0.02)
    assert 0 < value(during, "jaxserve:kv_cache_usage_perc") < 1
    request.join()
    idle = scrape(server)
    assert value(idle, "jaxserve:num_requests_running") == 0 and value(idle, "jaxserve:kv_cache_usage_perc") == 0


def test_engine_counters_are_read_from_its_stats(server, monkeypatch):
    stats = dataclasses.replace(server.async_engine.stats, num_preemptions=3, prefix_cache_queries=700,
                                prefix_cache_hits=512, spec_decode_num_drafts=40, spec_decode_num_draft_tokens=160,
                                spec_decode_num_accepted_tokens=70, spec_decode_num_accepted_tokens_per_pos=(30, 20, 15, 5))
    monkeypatch.setattr(server.async_engine, "stats", stats)
    samples = scrape(server)
    assert value(samples, "jaxserve:num_preemptions_total") == 3
    assert value(samples, "jaxserve:prefix_cache_queries_total") == 700
    assert value(samples, "jaxserve:prefix_cache_hits_total") == 512
    assert value(samples, "jaxserve:spec_decode_num_drafts_total") == 40
    assert value(samples, "jaxserve:spec_decode_num_draft_tokens_total") == 160
    assert value(samples, "jaxserve:spec_decode_num_accepted_tokens_total") == 70
    assert [value(samples, "jaxserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(4)] == [30, 20, 15, 5]


def test_prefix_cache_counters_move_with_a_repeated_prompt(server, tiny_engine):
    prompt = list(range(1000, 1040))   # two and a half 16-token pages
    before = scrape(server)
    for _ in range(2):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert requests.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    after = scrape(server)

    def moved(name):
        return value(after, name) - value(before, name)

    queries, hits = moved("jaxserve:prefix_cache_queries_total"), moved("jaxserve:prefix_cache_hits_total")
    assert queries >= len(prompt), "both prompts were looked up"
    assert 32 <= hits <= len(prompt), "the second found at least the first's two full pages"
