"""Metrics: the Prometheus counters move as requests complete, and the stats line reports throughput."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.metrics import LoggingStatLogger, PrometheusStatLogger
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
    value = registry.get_sample_value(f"pagedllm:{name}", {"model_name": "tiny", **labels})
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
