"""Prometheus metrics and the periodic stats line, fed by the front end.

The engine core reports `SchedulerStats` with its outputs, and per-request events (queued, scheduled) with
each request's outputs; the front end adds what it sees per request (`IterationStats`: first tokens,
inter-token gaps, finished requests; see output_processor.py for the definitions and clocks of every
interval) and owns the registry. Names follow vLLM's, under the `pagedllm:` prefix, each with a `model_name`
and an `engine` label (prometheus_client exports counters with a `_total` suffix and histograms as `_bucket`, `_sum` and
`_count`). A stat logger is anything with `record(scheduler_stats, iteration_stats, engine_idx=0)`, called once
per engine step with the index of the data-parallel engine that ran it; `AsyncLLM.stat_loggers` holds them.
The families are registered once per registry (`PrometheusMetrics`); the router's models share them, each model's
`PrometheusStatLogger` writing the series of its own `model_name`.
With speculative decoding the core also reports its drafts (the `spec_decode_*` counters, and the draft acceptance
rate and mean acceptance length on the stats line).

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


class PrometheusMetrics:
    """The `pagedllm:` metric families, registered once in `registry` (a name cannot be registered twice). Every
    series has the labels `model_name` and `engine`; the loggers of several models (the router's) share one
    instance, each writing its own `model_name`. The token-count histograms' buckets go up to `max_model_len`."""

    def __init__(self, max_model_len: int, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["model_name", "engine"]
        families: dict[str, Any] = {}

        def gauge(name: str, doc: str) -> None:
            families[name] = Gauge(f"pagedllm:{name}", doc, labels, registry=registry)

        def counter(name: str, doc: str) -> None:
            families[name] = Counter(f"pagedllm:{name}", doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: Any) -> None:
            families[name] = Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=registry)

        gauge("num_requests_running", "Requests in the running set")
        gauge("num_requests_waiting", "Requests waiting to be scheduled")
        gauge("kv_cache_usage_perc", "KV cache usage (1 = 100%)")
        counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        counter("num_preemptions", "Preemptions by the scheduler")
        counter("prompt_tokens", "Prompt tokens of requests that started generating")
        counter("generation_tokens", "Generated tokens")
        tokens = _token_buckets(max_model_len)
        histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        histogram("inter_token_latency_seconds", "Time between tokens of a request", _LATENCY_BUCKETS)
        histogram("e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        histogram("request_queue_time_seconds", "Engine core received the request to first scheduled", _REQUEST_BUCKETS)
        histogram(
            "request_prefill_time_seconds", "First scheduled to first token (engine-core clock)", _REQUEST_BUCKETS
        )
        histogram("request_decode_time_seconds", "First token to last token (engine-core clock)", _REQUEST_BUCKETS)
        histogram("request_prompt_tokens", "Prompt tokens per finished request", tokens)
        histogram("request_generation_tokens", "Generated tokens per finished request", tokens)
        counter("spec_decode_num_drafts", "Speculative decoding: verifications of draft tokens")
        counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified")
        counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted")
        histogram(
            "iteration_tokens",
            "Tokens scheduled per engine step",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
        )
        self.families = families
        self.success = Counter(
            "pagedllm:request_success",
            "Finished requests by finish reason",
            labels + ["finished_reason"],
            registry=registry,
        )
        self.per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position",
            labels + ["position"],
            registry=registry,
        )
        # vLLM's LoRA gauge: the adapters running and waiting in its labels, the time of the update as its value
        # (the latest label set is the current one; the previous one is removed).
        self.lora_info = Gauge(
            "pagedllm:lora_requests_info",
            "LoRA adapters of the running and waiting requests (in the labels; the value is the update's time)",
            labels + ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )


class PrometheusStatLogger:
    """Writes one model's series of the `pagedllm:` metrics: those of `metrics` when given (shared by several
    models' loggers), else of families it registers in `registry` itself (then one logger per registry). The
    series of engines 0 .. num_engines-1 (the data-parallel engine's index, "0" without data parallelism, as
    vLLM's) exist from the start."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        registry: CollectorRegistry = REGISTRY,
        num_engines: int = 1,
        max_lora: int = 0,
        metrics: PrometheusMetrics | None = None,
    ) -> None:
        self.model_name = model_name
        metrics = metrics or PrometheusMetrics(max_model_len, registry)
        self._families = metrics.families
        self._success = metrics.success
        self._per_pos = metrics.per_pos
        self._lora_info = metrics.lora_info
        self.max_lora = max_lora
        self._lora_labels: dict[int, tuple[str, ...]] = {}
        self._engines: dict[int, dict[str, Any]] = {}
        for engine_idx in range(num_engines):
            self._engine(engine_idx)

    def _engine(self, engine_idx: int) -> dict[str, Any]:
        """The series of one engine, by metric name (made on first use)."""
        series = self._engines.get(engine_idx)
        if series is None:
            engine = str(engine_idx)
            series = {name: family.labels(self.model_name, engine) for name, family in self._families.items()}
            for reason in _SUCCESS_REASONS:
                self._success.labels(self.model_name, engine, reason)
            self._engines[engine_idx] = series
        return series

    def record(self, sched: SchedulerStats | None, stats: IterationStats, engine_idx: int = 0) -> None:
        m = self._engine(engine_idx)
        if sched is not None:
            m["num_requests_running"].set(sched.num_running_reqs)
            m["num_requests_waiting"].set(sched.num_waiting_reqs)
            m["kv_cache_usage_perc"].set(sched.kv_cache_usage)
            m["prefix_cache_queries"].inc(sched.prefix_cache_queries)
            m["prefix_cache_hits"].inc(sched.prefix_cache_hits)
            m["num_preemptions"].inc(sched.num_preemptions)
            if sched.num_scheduled_tokens:
                m["iteration_tokens"].observe(sched.num_scheduled_tokens)
            if sched.running_lora_adapters is not None:
                self._record_loras(sched, engine_idx)
            spec = sched.spec_decoding_stats
            if spec is not None:
                m["spec_decode_num_drafts"].inc(spec.num_drafts)
                m["spec_decode_num_draft_tokens"].inc(spec.num_draft_tokens)
                m["spec_decode_num_accepted_tokens"].inc(spec.num_accepted_tokens)
                for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                    self._per_pos.labels(self.model_name, str(engine_idx), str(pos)).inc(n)
        m["prompt_tokens"].inc(stats.num_prompt_tokens)
        m["generation_tokens"].inc(stats.num_generation_tokens)
        for v in stats.time_to_first_tokens:
            m["time_to_first_token_seconds"].observe(v)
        for v in stats.inter_token_latencies:
            m["inter_token_latency_seconds"].observe(v)
        for f in stats.finished:
            self._success.labels(self.model_name, str(engine_idx), f.finish_reason).inc()
            m["e2e_request_latency_seconds"].observe(f.e2e_latency)
            # None only when the core sent no timestamps for the request (not the case for this engine core).
            if f.queue_time is not None:
                m["request_queue_time_seconds"].observe(f.queue_time)
            if f.prefill_time is not None:
                m["request_prefill_time_seconds"].observe(f.prefill_time)
            if f.decode_time is not None:
                m["request_decode_time_seconds"].observe(f.decode_time)
            m["request_prompt_tokens"].observe(f.num_prompt_tokens)
            m["request_generation_tokens"].observe(f.num_generation_tokens)

    def _record_loras(self, sched: SchedulerStats, engine_idx: int) -> None:
        labels = (
            self.model_name,
            str(engine_idx),
            str(self.max_lora),
            ",".join(sorted(sched.waiting_lora_adapters or {})),
            ",".join(sorted(sched.running_lora_adapters or {})),
        )
        previous = self._lora_labels.get(engine_idx)
        if previous is not None and previous != labels:
            self._lora_info.remove(*previous)
        self._lora_labels[engine_idx] = labels
        self._lora_info.labels(*labels).set_to_current_time()


class LoggingStatLogger:
    """Logs one line every `interval` seconds while the engine is busy (vLLM's "Avg prompt throughput" line); with
    data parallelism, one line per engine, each starting with "Engine <index>:"; with a `model_name` (the router's
    models), each line starts with "Model <name>:"."""

    def __init__(
        self, interval: float = DEFAULT_STATS_LOG_INTERVAL_S, num_engines: int = 1, model_name: str | None = None
    ) -> None:
        self.interval = interval
        self.num_engines = num_engines
        self.model_name = model_name
        self.last: dict[int, SchedulerStats] = {}
        self._counts: dict[int, list[int]] = {}  # engine -> [prompt, generation, prefix queries, prefix hits]
        self._spec: dict[int, list[int]] = {}  # engine -> [drafts, draft tokens, accepted] (speculative decoding)
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self._counts = {i: [0, 0, 0, 0] for i in range(self.num_engines)}
        self._spec = {}

    def record(self, sched: SchedulerStats | None, stats: IterationStats, engine_idx: int = 0) -> None:
        counts = self._counts.setdefault(engine_idx, [0, 0, 0, 0])
        counts[0] += stats.num_prompt_tokens
        counts[1] += stats.num_generation_tokens
        if sched is not None:
            self.last[engine_idx] = sched
            counts[2] += sched.prefix_cache_queries
            counts[3] += sched.prefix_cache_hits
            spec = sched.spec_decoding_stats
            if spec is not None:
                total = self._spec.setdefault(engine_idx, [0, 0, 0])
                total[0] += spec.num_drafts
                total[1] += spec.num_draft_tokens
                total[2] += spec.num_accepted_tokens
        now = time.monotonic()
        if now - self.since >= self.interval:
            self.log(now)

    def log(self, now: float | None = None) -> str:
        """Log (and return) the line of each engine since the last one."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.since, 1e-9)
        lines = []
        for engine_idx, (prompt, generation, queries, hits) in sorted(self._counts.items()):
            s = self.last.get(engine_idx) or SchedulerStats()
            hit_rate = 100.0 * hits / queries if queries else 0.0
            prefix = f"Engine {engine_idx:03d}: " if len(self._counts) > 1 else ""
            if self.model_name is not None:
                prefix = f"Model {self.model_name}: {prefix}"
            line = (
                f"{prefix}Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
            )
            spec = self._spec.get(engine_idx)
            if spec is not None:
                drafts, drafted, accepted = spec
                rate = 100.0 * accepted / drafted if drafted else 0.0
                mean_len = 1 + accepted / drafts if drafts else 0.0
                line += (
                    f", Draft acceptance rate: {rate:.1f}% ({accepted} of {drafted} draft tokens), "
                    f"Mean acceptance length: {mean_len:.2f}"
                )
            logger.info(line)
            lines.append(line)
        self._reset(now)
        return "\n".join(lines)
