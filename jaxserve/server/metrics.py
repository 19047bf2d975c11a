"""Prometheus metrics under vLLM's names with our prefix, so existing dashboards map one to one.

Each app has its own registry (several servers in one process do not collide). Gauges and the
engine's cumulative counters (preemptions, prefix cache) are read from the async engine's latest
stats when scraped; the rest is fed by `RequestObserver` calls.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from jaxserve.engine.async_engine import EngineStats

PREFIX = "jaxserve:"
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                480.0, 960.0)


class Metrics:
    """The server's metrics; a `RequestObserver` for the async engine."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
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
        self._label = label
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Time between a request's steps.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.registry.register(_EngineCounters(label, stats))

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

    def finished(self, finish_reasons: list[str], seconds: float) -> None:
        for reason in finish_reasons:
            self._success.labels(**self._label, finished_reason=reason).inc()
        self._e2e.observe(seconds)


class _EngineCounters:
    """Counters the engine keeps itself (cumulative fields of `EngineStats`), read when scraped: a
    prometheus `Counter` can only be incremented, not read from a function."""

    COUNTERS = (   # (EngineStats field = metric name, help)
        ("num_preemptions", "Sequences preempted (their pages freed, later recomputed)."),
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)."),
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
