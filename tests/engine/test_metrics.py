"""Metrics: the Prometheus counters move as requests complete, the stats line reports throughput, and the
queue / prefill / decode times follow vLLM's definitions on the engine core's timestamps, also under preemption."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pagedllm import RequestOutput, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.output_processor import FinishedRequestStats, IterationStats
from pagedllm.engine.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreOutputs, SchedulerStats
from pagedllm.metrics import STATS_LOG_INTERVAL_ENV, LoggingStatLogger, PrometheusStatLogger, stats_log_interval
from tests.engine.test_spec_decode import REPEATING
from tests.model_utils import make_tiny_model, random_prompts

NAMES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens",
]


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(f"pagedllm:{name}", {"model_name": "tiny", "engine": "0", **labels})
    return 0.0 if value is None else value


def test_metrics_move_and_stats_line(tiny_model_dir):
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM")

    async def main() -> None:
        engine = AsyncLLM(
            EngineArgs(
                model=folder, max_model_len=256, kv_cache_memory_bytes="16MiB", num_threads=1, served_model_name="tiny"
            )
        )
        registry = CollectorRegistry()
        prom = PrometheusStatLogger("tiny", 256, registry)
        line_logger = LoggingStatLogger(interval=3600)
        engine.stat_loggers += [prom, line_logger]
        try:
            prompts = random_prompts([20, 20, 33], seed=9)
            prompts[1] = list(prompts[0])  # a prefix-cache hit for the second request

            async def run(i: int, max_tokens: int) -> None:
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                async for _ in engine.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}"):
                    pass

            await run(0, 6)
            await asyncio.gather(run(1, 6), run(2, 9))
        finally:
            engine.shutdown()
        text = generate_latest(registry).decode()
        for name in NAMES:
            assert f"pagedllm:{name}" in text, name
        assert _value(registry, "request_success_total", finished_reason="length") == 3
        assert _value(registry, "generation_tokens_total") == 6 + 6 + 9
        assert _value(registry, "prompt_tokens_total") == 20 + 20 + 33
        assert _value(registry, "prefix_cache_hits_total") > 0
        assert _value(registry, "prefix_cache_queries_total") >= 20 + 20 + 33
        assert _value(registry, "time_to_first_token_seconds_count") == 3
        assert _value(registry, "inter_token_latency_seconds_count") == 5 + 5 + 8
        assert _value(registry, "request_generation_tokens_sum") == 21
        assert _value(registry, "iteration_tokens_count") > 0
        line = line_logger.log()
        assert "Avg generation throughput" in line and "Prefix cache hit rate" in line
        assert "tokens/s" in line

    asyncio.run(main())


class _Recorder:
    """A stat logger that keeps every finished request's stats, by engine-core request id."""

    def __init__(self) -> None:
        self.finished: dict[str, FinishedRequestStats] = {}

    def record(self, sched: SchedulerStats | None, stats: IterationStats, engine_idx: int = 0) -> None:
        for f in stats.finished:
            self.finished[f.request_id] = f


def test_queue_prefill_decode_times_with_preemption(tiny_model_dir):
    """13 blocks of 8 tokens for six concurrent requests of up to 92 tokens: some are preempted and scheduled
    again. Every request's queue / prefill / decode time follows vLLM's definitions on the core's timestamps
    (the first SCHEDULED counts, also for a preempted request) and fits inside its TTFT and E2E latency."""
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM")
    prefix, *rest = random_prompts([24, 7, 16, 20, 31, 40, 60], seed=30)
    prompts = [prefix + rest[0], rest[2], prefix + rest[1], rest[3], prefix + rest[4], rest[5]]
    max_tokens = 32
    events: dict[str, list[EngineCoreEvent]] = defaultdict(list)
    token_steps: dict[str, list[float]] = defaultdict(list)  # core timestamps of the steps with new tokens
    results: dict[str, RequestOutput] = {}

    async def main() -> None:
        engine = AsyncLLM(
            EngineArgs(
                model=folder,
                max_model_len=96,
                block_size=8,
                num_gpu_blocks_override=13,
                max_num_batched_tokens=32,
                num_threads=1,
                served_model_name="tiny",
            )
        )
        client = engine.engine_core
        original = client.get_output_async

        async def spy() -> EngineCoreOutputs:
            outputs = await original()
            for out in outputs.outputs:
                events[out.request_id].extend(out.events or [])
                if out.new_token_ids:
                    token_steps[out.request_id].append(outputs.timestamp)
            return outputs

        client.get_output_async = spy
        registry = CollectorRegistry()
        recorder = _Recorder()
        engine.stat_loggers += [PrometheusStatLogger("tiny", 96, registry), recorder]

        async def run(i: int) -> None:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}"):
                results[f"r{i}"] = out

        try:
            await asyncio.gather(*(run(i) for i in range(len(prompts))))
        finally:
            engine.shutdown()
        return registry, recorder

    registry, recorder = asyncio.run(main())
    assert set(recorder.finished) == set(results) == {f"r{i}" for i in range(len(prompts))}
    preempted = [rid for rid, evs in events.items() if any(e.type == EngineCoreEventType.PREEMPTED for e in evs)]
    assert preempted, "the workload was meant to force a preemption"
    eps = 1e-3  # two clocks (front-end wall, core monotonic) tick at the same rate; allow for rounding only
    for rid, f in recorder.finished.items():
        kinds = [e.type for e in events[rid]]
        assert kinds[0] == EngineCoreEventType.QUEUED and kinds.count(EngineCoreEventType.QUEUED) == 1, kinds
        scheduled = [e.timestamp for e in events[rid] if e.type == EngineCoreEventType.SCHEDULED]
        # Admitted once, plus once per preemption.
        assert len(scheduled) == 1 + kinds.count(EngineCoreEventType.PREEMPTED), kinds
        assert scheduled == sorted(scheduled)
        queued = events[rid][0].timestamp
        assert f.queue_time == max(scheduled[0] - queued, 0.0)
        assert f.prefill_time == token_steps[rid][0] - scheduled[0]
        assert f.decode_time == token_steps[rid][-1] - token_steps[rid][0]
        assert f.queue_time >= 0 and f.prefill_time > 0 and f.decode_time > 0, f
        metrics = results[rid].metrics
        ttft = metrics.first_token_time - metrics.arrival_time
        assert f.queue_time + f.prefill_time <= ttft + eps, (f, ttft)
        assert f.queue_time + f.prefill_time + f.decode_time <= f.e2e_latency + eps, f
        assert f.num_generation_tokens == max_tokens
    for rid in preempted:
        f = recorder.finished[rid]
        scheduled = [e.timestamp for e in events[rid] if e.type == EngineCoreEventType.SCHEDULED]
        assert len(scheduled) >= 2 and scheduled[-1] > scheduled[0]
        assert f.queue_time < scheduled[-1] - events[rid][0].timestamp  # the first SCHEDULED, not the last
    n = len(prompts)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert _value(registry, f"{name}_count") == n, name
    assert math.isclose(
        _value(registry, "request_queue_time_seconds_sum"), sum(f.queue_time for f in recorder.finished.values())
    )
    assert math.isclose(
        _value(registry, "request_prefill_time_seconds_sum"), sum(f.prefill_time for f in recorder.finished.values())
    )
    assert _value(registry, "num_preemptions_total") >= len(preempted)


def test_gauges_back_to_zero_after_client_abort(tiny_model_dir):
    """A consumer that leaves early aborts its request; the last step's stats still counted it running, so the
    front end asks the core for fresh stats: running, waiting and KV usage read 0 once the engine is idle."""
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM")

    async def main() -> CollectorRegistry:
        engine = AsyncLLM(
            EngineArgs(
                model=folder, max_model_len=256, kv_cache_memory_bytes="16MiB", num_threads=1, served_model_name="tiny"
            )
        )
        registry = CollectorRegistry()
        engine.stat_loggers.append(PrometheusStatLogger("tiny", 256, registry))
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = engine.generate({"prompt_token_ids": random_prompts([30], seed=4)[0]}, params, "leaver")
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()  # the generator's finally aborts the request
            assert _value(registry, "num_requests_running") == 1  # the stats of a step it ran in
            for _ in range(200):
                if _value(registry, "num_requests_running") == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await engine.check_invariants())["unfinished"] == 0
        finally:
            engine.shutdown()
        return registry

    registry = asyncio.run(main())
    assert _value(registry, "num_requests_running") == 0
    assert _value(registry, "num_requests_waiting") == 0
    assert _value(registry, "kv_cache_usage_perc") == 0
    assert _value(registry, "request_success_total", finished_reason="length") == 0  # aborts are not successes


def test_stats_log_interval_from_env(monkeypatch):
    monkeypatch.delenv(STATS_LOG_INTERVAL_ENV, raising=False)
    assert stats_log_interval() == 5.0
    monkeypatch.setenv(STATS_LOG_INTERVAL_ENV, "0.25")
    assert stats_log_interval() == 0.25
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(STATS_LOG_INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=STATS_LOG_INTERVAL_ENV):
            stats_log_interval()


def test_spec_decode_metrics_and_stats_line():
    """With speculative decoding the core reports its drafts: vLLM's spec_decode_* counters (per draft position too)
    and the stats line's acceptance rate, checked against the engine core's own running totals."""
    from pagedllm.engine.protocol import SpecDecodingStats

    registry = CollectorRegistry()
    prom = PrometheusStatLogger("tiny", 256, registry)
    line_logger = LoggingStatLogger(interval=3600)
    for stats in (SpecDecodingStats(2, 7, 4, [2, 1, 1]), SpecDecodingStats(1, 3, 3, [1, 1, 1])):
        sched = SchedulerStats(spec_decoding_stats=stats)
        prom.record(sched, IterationStats())
        line_logger.record(sched, IterationStats())
    assert _value(registry, "spec_decode_num_drafts_total") == 3
    assert _value(registry, "spec_decode_num_draft_tokens_total") == 10
    assert _value(registry, "spec_decode_num_accepted_tokens_total") == 7
    for pos, want in enumerate([3, 2, 2]):
        assert _value(registry, "spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == want
    line = line_logger.log()
    assert "Draft acceptance rate: 70.0% (7 of 10 draft tokens)" in line
    assert "Mean acceptance length: 3.33" in line

    async def main() -> None:
        # The default model, which copies a quote it is asked to repeat (a random tiny model repeats nothing).
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
        engine = AsyncLLM(
            EngineArgs(
                max_model_len=512, kv_cache_memory_bytes="32MiB", served_model_name="tiny", speculative_config=spec
            )
        )
        registry = CollectorRegistry()
        engine.stat_loggers.append(PrometheusStatLogger("tiny", 256, registry))
        try:
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            async for _ in engine.generate(REPEATING[1], params, "s0"):
                pass
        finally:
            engine.shutdown()
        drafts = _value(registry, "spec_decode_num_drafts_total")
        drafted = _value(registry, "spec_decode_num_draft_tokens_total")
        accepted = _value(registry, "spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and drafts <= drafted <= 3 * drafts and accepted <= drafted
        per_pos = [_value(registry, "spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        assert _value(registry, "generation_tokens_total") == 24

    asyncio.run(main())
