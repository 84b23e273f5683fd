"""Data parallelism (`--data-parallel-size N`): N engine-core processes behind one front end.

- Offline (`LLM`, tiny model): DP=2 gives DP=1's greedy tokens, the requests are spread over both engines, the n
  children of a request share one engine, and the block pools of both are clean afterwards.
- Online (`AsyncLLM`, tiny model): streams abandoned half-way are aborted in the engine that ran them: both
  engines end with no unfinished request and the router with no load.
- The server on the default model with `-dp 2`: 32 concurrent requests all complete, the per-engine metrics
  (`engine` label) show that both engines served some, and a kill -9 of one engine brings the server down cleanly
  (/health 503, a non-zero exit, no process left).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from tests.distributed.procs import marked, wait_for
from tests.model_utils import make_tiny_model, random_prompts
from tests.server.server_utils import RemoteServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def tiny_folder(tiny_model_dir: Path) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=5, max_position_embeddings=512)


def _greedy(folder: str, prompts: list[list[int]], **kwargs: object) -> tuple[list[list[int]], list[int], dict]:
    """Greedy tokens of `prompts`, the engine each request went to, and the final block-pool check."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(folder, max_model_len=256, kv_cache_memory_bytes="16MiB", num_threads=2, **kwargs) as llm:
        engines: list[int] = []
        client = llm.engine_core
        original = client.add_request

        def spy(request, engine=None):  # noqa: ANN001, ANN202
            chosen = original(request, engine)
            engines.append(chosen)
            return chosen

        client.add_request = spy
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # Two samples of one prompt: both children go to the same engine.
        engines_before = len(engines)
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(n=2, max_tokens=4, seed=1), use_tqdm=False)
        assert len(set(engines[engines_before:])) == 1, engines
        stats = llm.check_invariants()
    return [o.outputs[0].token_ids for o in outs], engines[:engines_before], stats


def test_dp2_offline_gives_dp1_tokens_over_both_engines(tiny_folder: str) -> None:
    prompts = random_prompts([9, 17, 30, 5, 22, 41, 13, 26], seed=3)
    reference, engines1, stats1 = _greedy(tiny_folder, prompts)
    tokens, engines2, stats2 = _greedy(tiny_folder, prompts, data_parallel_size=2)
    assert tokens == reference
    assert set(engines1) == {0}
    assert sorted(engines2) == [0] * 4 + [1] * 4  # all sent at once: the least-loaded engine alternates
    assert "engines" not in stats1
    assert len(stats2["engines"]) == 2
    assert stats2["unfinished"] == 0 and stats2["in_use"] == 0
    assert stats2["num_blocks"] == sum(e["num_blocks"] for e in stats2["engines"])


def test_dp_size_is_validated(tiny_folder: str) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1, got 0"):
        LLM(tiny_folder, data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size 2 needs the multiprocess engine client"):
        LLM(tiny_folder, data_parallel_size=2, engine_client="inproc")


def test_aborts_reach_the_engine_that_runs_the_request(tiny_folder: str) -> None:
    async def main() -> None:
        engine = AsyncLLM(
            EngineArgs(
                model=tiny_folder,
                max_model_len=256,
                kv_cache_memory_bytes="16MiB",
                num_threads=2,
                data_parallel_size=2,
            )
        )
        try:
            assert engine.num_engines == 2
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            prompts = random_prompts([12, 18, 25, 31], seed=8)
            seen_engines: set[int] = set()

            async def leave_early(i: int) -> None:
                stream = engine.generate({"prompt_token_ids": prompts[i]}, params, f"leaver-{i}")
                count = 0
                async for _ in stream:
                    seen_engines.add(engine.engine_core.router.engine_of[f"leaver-{i}"])
                    count += 1
                    if count == 3:
                        break
                await stream.aclose()  # aborts the request in its engine

            await asyncio.gather(*(leave_early(i) for i in range(4)))
            assert seen_engines == {0, 1}
            assert engine.engine_core.router.load == [0, 0]
            stats = await engine.check_invariants()
            for per_engine in stats["engines"]:
                assert per_engine["unfinished"] == 0 and per_engine["in_use"] == 0, stats
            # The engines still serve after the aborts.
            outs = [o async for o in engine.generate({"prompt_token_ids": prompts[0]}, params.clone(max_tokens=3), "x")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        finally:
            engine.shutdown()

    asyncio.run(main())


def _success_by_engine(srv: RemoteServer) -> dict[str, float]:
    status, text = srv.request("GET", "/metrics")
    assert status == 200, text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pagedllm:request_success":
            for s in family.samples:
                if s.name.endswith("_total"):
                    counts[s.labels["engine"]] = counts.get(s.labels["engine"], 0.0) + s.value
    return counts


def test_dp2_server_on_the_default_model() -> None:
    marker = f"PAGEDLLM_TEST_{uuid.uuid4().hex}"
    srv = RemoteServer("-dp", "2", "--enable-debug-routes", env={marker: "1"})
    try:
        kv = srv.kv()
        assert len(set(kv["core_pids"])) == 2 and kv["core_pid"] == kv["core_pids"][0]
        assert _success_by_engine(srv) == {"0": 0.0, "1": 0.0}  # both engines' series exist from the start

        model = srv.request("GET", "/v1/models")[1]["data"][0]["id"]

        async def burst() -> list:
            client = srv.async_client()
            words = ["France", "Italy", "Japan", "Peru", "Kenya", "Norway", "Chile", "Egypt"]
            calls = [
                client.completions.create(
                    model=model, prompt=f"The capital of {words[i % 8]} is", max_tokens=8, temperature=0
                )
                for i in range(32)
            ]
            return await asyncio.gather(*calls)

        responses = asyncio.run(burst())
        assert len(responses) == 32
        assert all(r.choices[0].finish_reason in ("stop", "length") and r.choices[0].text for r in responses)
        assert wait_for(lambda: sum(_success_by_engine(srv).values()) == 32, timeout=10), _success_by_engine(srv)
        served = _success_by_engine(srv)
        assert served["0"] > 0 and served["1"] > 0, served
        idle = srv.wait_idle()
        assert idle["unfinished"] == 0 and len(idle["engines"]) == 2

        # One engine killed: the whole server goes down cleanly.
        os.kill(kv["core_pids"][1], signal.SIGKILL)
        assert wait_for(lambda: srv.request("GET", "/health")[0] == 503, timeout=10)
        assert srv.proc.wait(timeout=30) != 0
        assert wait_for(lambda: not marked(marker), timeout=20), marked(marker)
    finally:
        srv.stop(signal.SIGKILL)


def test_router_least_loaded_ties_and_forgetting() -> None:
    from pagedllm.engine.core_client import EngineRouter
    from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats

    router = EngineRouter(3)
    for rid in "abc":
        router.add(rid, router.choose())
    assert router.engine_of == {"a": 0, "b": 1, "c": 2}
    # Equal loads: the engine with fewer waiting requests in its last stats wins.
    router.observe(EngineCoreOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=4), engine_index=0))
    router.observe(EngineCoreOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=1), engine_index=1))
    router.observe(EngineCoreOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=2), engine_index=2))
    assert router.choose() == 1
    # A finished request frees its engine; an unfinished output does not.
    done = EngineCoreOutput("c", [5], finish_reason=FinishReason.LENGTH)
    router.observe(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1]), done], engine_index=2))
    assert router.load == [1, 1, 0] and router.choose() == 2
    # Aborts go to the engine holding the request; an unknown id goes to every engine.
    assert router.remove(["b", "zz"]) == {1: ["b", "zz"], 0: ["zz"], 2: ["zz"]}
    assert router.load == [1, 0, 0] and router.engine_of == {"a": 0}


def test_stat_loggers_per_engine() -> None:
    from prometheus_client import CollectorRegistry

    from pagedllm.engine.output_processor import IterationStats
    from pagedllm.engine.protocol import SchedulerStats
    from pagedllm.metrics import LoggingStatLogger, PrometheusStatLogger

    registry = CollectorRegistry()
    prom = PrometheusStatLogger("m", 64, registry, num_engines=2)
    lines = LoggingStatLogger(interval=3600, num_engines=2)
    for logger_ in (prom, lines):
        stats = IterationStats()
        stats.num_generation_tokens = 7
        logger_.record(SchedulerStats(num_running_reqs=3), stats, engine_idx=1)
    assert registry.get_sample_value("pagedllm:num_requests_running", {"model_name": "m", "engine": "1"}) == 3
    assert registry.get_sample_value("pagedllm:num_requests_running", {"model_name": "m", "engine": "0"}) == 0
    assert registry.get_sample_value("pagedllm:generation_tokens_total", {"model_name": "m", "engine": "1"}) == 7
    text = lines.log()
    assert text.startswith("Engine 000: ") and "\nEngine 001: " in text and "Running: 3 reqs" in text
