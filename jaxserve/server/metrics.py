"""Prometheus metrics under vLLM's names with our prefix, so existing dashboards map one to one.

Each app has its own registry (several servers in one process do not collide). Gauges and the
engine's cumulative counters (preemptions, prefix cache) are read from the async engine's latest
stats when scraped; the rest is fed by `RequestObserver` calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.async_engine import EngineStats, FinishedRequest

PREFIX = "jaxserve:"
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                480.0, 960.0)
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)


class Metrics:
    """The server's metrics; a `RequestObserver` for the async engine."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], cache_config: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def gauge(name: str, doc: str, read: Callable[[EngineStats], float]) -> None:
            metric = Gauge(PREFIX + name, doc, list(label), registry=self.registry)
            metric.labels(**label).set_function(lambda: read(stats()))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*label, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, list(label), buckets=buckets,
                             registry=self.registry).labels(**label)

        gauge("num_requests_running", "Sequences in the running batch.", lambda s: s.num_running)
        gauge("num_requests_waiting", "Sequences waiting to be scheduled.", lambda s: s.num_waiting)
        gauge("kv_cache_usage_perc", "Fraction of KV cache pages in use (0 to 1).", lambda s: s.kv_cache_usage)
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens received.").labels(**label)
        self._generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**label)
        self._success = counter("request_success", "Finished sequences, by finish reason.", ("finished_reason",))
        self._lora_requests = counter("lora_requests", "Finished requests, by LoRA adapter.", ("lora_name",))
        self._label = label
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Time between a request's steps.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self._queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _PHASE_BUCKETS)
        self._prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.", _PHASE_BUCKETS)
        self._decode = histogram("request_decode_time_seconds", "First token to finish.", _PHASE_BUCKETS)
        self._inference = histogram("request_inference_time_seconds", "First scheduled to finish.", _PHASE_BUCKETS)
        self._request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self._request_generation = histogram("request_generation_tokens", "Tokens generated per request.",
                                             _TOKEN_BUCKETS)
        self._params_n = histogram("request_params_n", "The n of each request.", _N_BUCKETS)
        self._params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of each request that "
                                            "gave one.", _TOKEN_BUCKETS)
        self._iteration = histogram("iteration_tokens_total", "Tokens computed per engine step.", _TOKEN_BUCKETS)
        self.registry.register(_EngineCounters(label, stats))
        self.registry.register(_LoraInfo(stats))
        if cache_config is not None:
            self.registry.register(_CacheConfig(cache_config))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- RequestObserver ----------------------------------------------------------------------

    def prompt_tokens(self, count: int) -> None:
        self._prompt_tokens.inc(count)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def new_tokens(self, count: int, seconds_since_last: float | None) -> None:
        self._generation_tokens.inc(count)
        if seconds_since_last is not None:
            self._itl.observe(seconds_since_last)

    def finished(self, request: FinishedRequest) -> None:
        for reason in request.finish_reasons:
            self._success.labels(**self._label, finished_reason=reason).inc()
        if request.lora_name is not None:
            self._lora_requests.labels(**self._label, lora_name=request.lora_name).inc()
        self._e2e.observe(request.e2e_seconds)
        self._params_n.observe(request.params.n)
        if request.params.max_tokens is not None:
            self._params_max_tokens.observe(request.params.max_tokens)
        if request.num_prompt_tokens is None:   # closed by its client first, or failed
            return
        self._request_prompt.observe(request.num_prompt_tokens)
        self._request_generation.observe(request.num_output_tokens)
        times = request.times
        if times is None or times.first_scheduled_time is None:
            return
        self._queue.observe(times.first_scheduled_time - times.arrival_time)
        self._inference.observe(request.finished_time - times.first_scheduled_time)
        if times.first_token_time is not None:
            self._prefill.observe(times.first_token_time - times.first_scheduled_time)
            self._decode.observe(request.finished_time - times.first_token_time)

    def iteration_tokens(self, count: int) -> None:   # on the engine thread: prometheus_client locks
        self._iteration.observe(count)


class _EngineCounters:
    """Counters the engine keeps itself (cumulative fields of `EngineStats`), read when scraped: a
    prometheus `Counter` can only be incremented, not read from a function."""

    COUNTERS = (   # (EngineStats field = metric name, help)
        ("num_preemptions", "Sequences preempted (their pages freed, later recomputed)."),
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)."),
        ("spec_decode_num_drafts", "Speculative decoding: sequences given drafts to verify."),
        ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed."),
        ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
    )

    def __init__(self, label: dict[str, str], stats: Callable[[], EngineStats]):
        self._label = label
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for name, doc in self.COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=list(self._label))
            family.add_metric(list(self._label.values()), getattr(stats, name))
            yield family
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative decoding: draft tokens accepted at each position.",
                                     labels=[*self._label, "position"])
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            family.add_metric([*self._label.values(), str(position)], count)
        yield family


class _LoraInfo:
    """vLLM's `lora_requests_info`: the adapters of running and waiting sequences (comma-separated)
    and the device slots, as labels of a gauge set to the time of the scrape (once LoRA is on)."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        if stats.max_lora:
            family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.",
                                       labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            family.add_metric([",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                               str(stats.max_lora)], time.time())
            yield family


class _CacheConfig:
    """vLLM's `cache_config_info`: the KV cache's settings as labels of a gauge set to 1 (read when
    scraped, once the engine is built)."""

    def __init__(self, read: Callable[[], dict]):
        self._read = read

    def collect(self):
        labels = self._read()
        if labels:
            family = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's settings.", labels=list(labels))
            family.add_metric([str(v) for v in labels.values()], 1.0)
            yield family
