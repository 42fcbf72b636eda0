"""Prometheus metrics of one node: counts and timings only, nothing that identifies prompt content."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NodeMetrics:
    def __init__(self, cached_bytes: Callable[[], float], queue_waiting: Callable[[], float],
                 snapshot_bytes: Callable[[], float] = lambda: 0.0,
                 forward_path: tuple[str, str, str] | None = None) -> None:
        """`forward_path`: (model, path, reason) of the served model, reported as an info gauge."""
        self.registry = CollectorRegistry()
        self.requests = Counter("tenzro_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("tenzro_prompt_tokens", "Prompt tokens, by whether they were computed "
                                     "(prefilled) or restored from stored state (reused)", ["source"],
                                     registry=self.registry)
        self.matched_tokens = Counter("tenzro_prompt_tokens_matched", "Prompt tokens that agreed with the caller's "
                                      "stored tokens: what resuming at any token would reuse",
                                      registry=self.registry)
        self.completion_tokens = Counter("tenzro_completion_tokens", "Generated tokens", registry=self.registry)
        self.ttft = Histogram("tenzro_time_to_first_token_seconds", "From taking the request off the queue to "
                              "the first generated token", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("tenzro_queue_wait_seconds", "Time a request waited for the model",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        cached = Gauge("tenzro_cached_bytes", "Bytes of prompt state held for reuse", registry=self.registry)
        cached.set_function(cached_bytes)
        snapshots = Gauge("tenzro_cached_snapshot_bytes", "Bytes of the cached state held in snapshots "
                          "(sliding-window tails, recurrent states)", registry=self.registry)
        snapshots.set_function(snapshot_bytes)
        waiting = Gauge("tenzro_queue_waiting", "Requests waiting for the model", registry=self.registry)
        waiting.set_function(queue_waiting)
        if forward_path is not None:
            forward = Gauge("tenzro_forward_path", "Which forward runs the model's short chunks and decode steps "
                            "(native CPU kernels or transformers), and why; always 1", ["model", "path", "reason"],
                            registry=self.registry)
            forward.labels(*forward_path).set(1)

    def observe_generation(self, prompt: int, reused: int, matched: int, completion: int, ttft_s: float,
                           wait_s: float) -> None:
        self.matched_tokens.inc(matched)
        self.prompt_tokens.labels(source="prefilled").inc(prompt - reused)
        self.prompt_tokens.labels(source="reused").inc(reused)
        self.completion_tokens.inc(completion)
        self.ttft.observe(ttft_s)
        self.queue_wait.observe(wait_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
