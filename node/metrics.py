"""Prometheus metrics of one node: counts and timings only, nothing that identifies prompt content.

Served to operator keys only. Per-request quantities (prompt, reused and completion tokens, latencies) are
histograms with coarse buckets and without their `_sum`: a scrape before and after one request shows which
bucket it fell into, not its exact counts or timing, so metrics cannot single out a caller's request.
Node-wide state (bytes held, requests by route and status, the queue) stays exact for capacity planning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.05, 0.25, 1.0, 5.0, 30.0)
TOKEN_BUCKETS = (64, 512, 4096, 32768)
REUSED_SHARE_BUCKETS = (0.0, 0.5, 0.9)


class _WithoutSums(Collector):
    """Histograms whose `_sum` samples are dropped (an exact sum, differenced, is one request's value)."""

    def __init__(self, histograms: list[Histogram]) -> None:
        self._histograms = histograms

    def collect(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            for family in histogram.collect():
                family.samples = [sample for sample in family.samples if not sample.name.endswith("_sum")]
                yield family


class _Counted(Collector):
    """Counters kept elsewhere (the engine's), read at scrape time."""

    def __init__(self, counters: list[tuple[str, str, Callable[[], float]]]) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        for name, documentation, read in self._counters:
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], read())
            yield family


class NodeMetrics:
    def __init__(self, cached_bytes: Callable[[], float], queue_waiting: Callable[[], float],
                 snapshot_bytes: Callable[[], float] = lambda: 0.0,
                 forward_backend: tuple[str, str, str] | None = None,
                 plaintext_bytes: Callable[[], float] = lambda: 0.0,
                 sealed_open_failures: Callable[[], float] = lambda: 0.0) -> None:
        """`forward_backend`: (model, backend, reason) of the served model (`node/engine/forward.py`), reported as an
        info gauge."""
        self.registry = CollectorRegistry()
        self.requests = Counter("tenzro_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Histogram("tenzro_prompt_tokens", "Prompt tokens per request", buckets=TOKEN_BUCKETS,
                                       registry=None)
        self.reused_share = Histogram("tenzro_prompt_reused_share", "Share of a request's prompt tokens restored "
                                      "from stored state", buckets=REUSED_SHARE_BUCKETS, registry=None)
        self.completion_tokens = Histogram("tenzro_completion_tokens", "Generated tokens per request",
                                           buckets=TOKEN_BUCKETS, registry=None)
        self.ttft = Histogram("tenzro_time_to_first_token_seconds", "From taking the request off the queue to "
                              "the first generated token", buckets=LATENCY_BUCKETS, registry=None)
        self.queue_wait = Histogram("tenzro_queue_wait_seconds", "Time a request waited for the model",
                                    buckets=LATENCY_BUCKETS, registry=None)
        self.registry.register(_WithoutSums([self.prompt_tokens, self.reused_share, self.completion_tokens,
                                             self.ttft, self.queue_wait]))
        cached = Gauge("tenzro_cached_bytes", "Bytes of prompt state held for reuse", registry=self.registry)
        cached.set_function(cached_bytes)
        snapshots = Gauge("tenzro_cached_snapshot_bytes", "Bytes of the cached state held in snapshots "
                          "(sliding-window tails, recurrent states)", registry=self.registry)
        snapshots.set_function(snapshot_bytes)
        plaintext = Gauge("tenzro_cached_plaintext_bytes", "Bytes of the cached state held unsealed (the hot tier, "
                          "besides the last working cache)", registry=self.registry)
        plaintext.set_function(plaintext_bytes)
        self.registry.register(_Counted([("tenzro_sealed_open_failures", "Sealed entries that failed "
                                          "authentication when opened (dropped, and the request recomputed)",
                                          sealed_open_failures)]))
        waiting = Gauge("tenzro_queue_waiting", "Requests waiting for the model", registry=self.registry)
        waiting.set_function(queue_waiting)
        if forward_backend is not None:
            forward = Gauge("tenzro_forward_backend", "Which forward backend runs the model (native-cpu: the CPU "
                            "kernels where they apply; library: transformers' modules), and why; always 1",
                            ["model", "backend", "reason"], registry=self.registry)
            forward.labels(*forward_backend).set(1)

    def observe_generation(self, prompt: int, reused: int, completion: int, ttft_s: float, wait_s: float) -> None:
        self.prompt_tokens.observe(prompt)
        self.reused_share.observe(reused / prompt if prompt else 0.0)
        self.completion_tokens.observe(completion)
        self.ttft.observe(ttft_s)
        self.queue_wait.observe(wait_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
