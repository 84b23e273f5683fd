"""Prometheus metrics and the periodic stats line, fed by the front end.

The engine core reports `SchedulerStats` with its outputs, and per-request events (queued, scheduled) with
each request's outputs; the front end adds what it sees per request (`IterationStats`: first tokens,
inter-token gaps, finished requests; see output_processor.py for the definitions and clocks of every
interval) and owns the registry. Names follow vLLM's, under the `pagedllm:` prefix, each with a `model_name`
label (prometheus_client exports counters with a `_total` suffix and histograms as `_bucket`, `_sum` and
`_count`). A stat logger is anything with `record(scheduler_stats, iteration_stats)`; `AsyncLLM.stat_loggers`
holds them.

The stats line is logged every `stats_log_interval()` seconds while the engine is busy: 5 s, or the value of
$PAGEDLLM_STATS_LOG_INTERVAL (read here, once, by the server at start-up).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.output_processor import IterationStats
from pagedllm.engine.protocol import SchedulerStats

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_ENV = "PAGEDLLM_STATS_LOG_INTERVAL"
DEFAULT_STATS_LOG_INTERVAL_S = 5.0
# Finish reasons whose request_success series exist from the start (at 0), so that rate() sees the first one.
# Aborted requests are not counted: the caller forgot them, no finished output is ever processed.
_SUCCESS_REASONS = ("stop", "length")


def stats_log_interval() -> float:
    """Seconds between stats lines: $PAGEDLLM_STATS_LOG_INTERVAL if set (a positive number), else 5."""
    raw = os.environ.get(STATS_LOG_INTERVAL_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_STATS_LOG_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"${STATS_LOG_INTERVAL_ENV} must be a positive number of seconds, got {raw!r}")
    return value


_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


def _token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's 1-2-5 series)."""
    buckets, base = [], 1
    while True:
        for m in (1, 2, 5):
            value = m * base
            if value > max_len:
                return buckets
            buckets.append(value)
        base *= 10


class PrometheusStatLogger:
    """Owns the `pagedllm:` metrics in `registry` (one logger per registry: names cannot be registered twice)."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"pagedllm:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running set")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage (1 = 100%)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "Preemptions by the scheduler")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self._success = Counter(
            "pagedllm:request_success",
            "Finished requests by finish reason",
            labels + ["finished_reason"],
            registry=registry,
        )
        for reason in _SUCCESS_REASONS:
            self._success.labels(model_name, reason)
        tokens = _token_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a request", _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        self.queue = histogram(
            "request_queue_time_seconds", "Engine core received the request to first scheduled", _REQUEST_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "First scheduled to first token (engine-core clock)", _REQUEST_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token (engine-core clock)", _REQUEST_BUCKETS
        )
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per finished request", tokens)
        self.req_gen = histogram("request_generation_tokens", "Generated tokens per finished request", tokens)
        self.iteration_tokens = histogram(
            "iteration_tokens",
            "Tokens scheduled per engine step",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
        )

    def record(self, sched: SchedulerStats | None, stats: IterationStats) -> None:
        if sched is not None:
            self.running.set(sched.num_running_reqs)
            self.waiting.set(sched.num_waiting_reqs)
            self.kv_usage.set(sched.kv_cache_usage)
            self.prefix_queries.inc(sched.prefix_cache_queries)
            self.prefix_hits.inc(sched.prefix_cache_hits)
            self.preemptions.inc(sched.num_preemptions)
            if sched.num_scheduled_tokens:
                self.iteration_tokens.observe(sched.num_scheduled_tokens)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for v in stats.time_to_first_tokens:
            self.ttft.observe(v)
        for v in stats.inter_token_latencies:
            self.itl.observe(v)
        for f in stats.finished:
            self._success.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            # None only when the core sent no timestamps for the request (not the case for this engine core).
            if f.queue_time is not None:
                self.queue.observe(f.queue_time)
            if f.prefill_time is not None:
                self.prefill.observe(f.prefill_time)
            if f.decode_time is not None:
                self.decode.observe(f.decode_time)
            self.req_prompt.observe(f.num_prompt_tokens)
            self.req_gen.observe(f.num_generation_tokens)


class LoggingStatLogger:
    """Logs one line every `interval` seconds while the engine is busy (vLLM's "Avg prompt throughput" line)."""

    def __init__(self, interval: float = DEFAULT_STATS_LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._reset(time.monotonic())
        self.last: SchedulerStats | None = None

    def _reset(self, now: float) -> None:
        self.since = now
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    def record(self, sched: SchedulerStats | None, stats: IterationStats) -> None:
        self.prompt_tokens += stats.num_prompt_tokens
        self.generation_tokens += stats.num_generation_tokens
        if sched is not None:
            self.last = sched
            self.prefix_queries += sched.prefix_cache_queries
            self.prefix_hits += sched.prefix_cache_hits
        now = time.monotonic()
        if now - self.since >= self.interval:
            self.log(now)

    def log(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.since, 1e-9)
        s = self.last or SchedulerStats()
        hit_rate = 100.0 * self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        line = (
            f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
            f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
        )
        logger.info(line)
        self._reset(now)
        return line
