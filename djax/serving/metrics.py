"""The server's Prometheus metrics, one `ServerMetrics` per server (its own registry, so
two servers in one process, as in the tests, never share counters).

The engine thread sets the queue, rows, call, host-time and memory figures; the HTTP layer sets
time to first chunk, end-to-end latency, finished and aborted requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250)
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_HOST_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.1)


class ServerMetrics:
    """Every metric of one server, registered in `self.registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("djax_queue_depth", "requests waiting for a row", registry=r)
        self.running_rows = Gauge("djax_running_rows", "rows decoding in the batch", registry=r)
        self.ttft = Histogram(
            "djax_time_to_first_chunk_seconds",
            "arrival to the first committed block sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "djax_request_latency_seconds",
            "arrival to the last chunk sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "djax_queue_seconds",
            "a request's wait from its submission to a batch row (per choice)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.block_call = Histogram(
            "djax_block_call_seconds",
            "one device call (refresh and denoising steps of every row's block)",
            buckets=_CALL_BUCKETS,
            registry=r,
        )
        self.host_gap = Histogram(
            "djax_host_seconds_between_calls",
            "host time the device waits before a block call (an upper bound; 0 when the "
            "call was queued before the last one ended)",
            buckets=_HOST_BUCKETS,
            registry=r,
        )
        self.memory_budget = Gauge(
            "djax_memory_budget_bytes",
            "device bytes block calls may use beside the weights (0: no budget)",
            registry=r,
        )
        self.call_bytes = Gauge(
            "djax_memory_call_bytes",
            "device bytes of the last block call's (batch, sequence) program beside the weights",
            registry=r,
        )
        self.device_bytes = Gauge(
            "djax_device_bytes_in_use",
            "device memory in use after the last block call read (the fullest device)",
            registry=r,
        )
        self.device_peak_bytes = Gauge(
            "djax_device_peak_bytes_in_use",
            "the most device memory in use since the server started (the fullest device)",
            registry=r,
        )
        self.compiles = Counter("djax_compiles", "programs compiled (warm-up included)", registry=r)
        self.requests = Counter(
            "djax_requests", "requests finished, by reason", ["reason"], registry=r
        )
        self.aborted = Counter(
            "djax_aborted_requests", "requests dropped before finishing (disconnects)", registry=r
        )
        self.generated_tokens = Counter(
            "djax_generated_tokens",
            "answer tokens sent to clients, counted as each choice ends (under a stop string "
            "up to the token that completed it, as usage counts them)",
            registry=r,
        )

    def exposition(self) -> bytes:
        """The text format `GET /metrics` serves."""
        return generate_latest(self.registry)
