"""The engine core in its own process: same results as in-process, AsyncLLM streaming/abort, dead-engine
detection, and no child process left behind. Uses a tiny random Llama built by the test."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedllm import LLM, RequestOutputKind, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import EngineDeadError
from tests.model_utils import make_tiny_model, random_prompts

ENGINE_KW = dict(max_model_len=256, kv_cache_memory_bytes="16MiB", num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_mp_client_matches_inproc_and_leaves_no_child(model_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 40, 90, 17], seed=3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    inproc = LLM(model_dir, engine_client="inproc", **ENGINE_KW)
    ref = [o.outputs[0].token_ids for o in inproc.generate(prompts, params, use_tqdm=False)]
    inproc.shutdown()
    with LLM(model_dir, engine_client="mp", **ENGINE_KW) as llm:
        pid = llm.engine_core.core.proc.pid
        assert pid != os.getpid() and _alive(pid)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == ref
        seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=11, ignore_eos=True)
        a = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
        b = llm.generate(prompts, seeded, use_tqdm=False)[0].outputs[0].token_ids
        assert a == b
        assert llm.check_invariants()["in_use"] == 0
    assert not _alive(pid)


def test_killed_core_raises_engine_dead_error(model_dir):
    llm = LLM(model_dir, engine_client="mp", **ENGINE_KW)
    try:
        os.kill(llm.engine_core.core.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):  # and again, not a hang
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()


def test_core_start_failure_is_reported(model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model_dir, engine_client="mp", max_model_len=256, num_gpu_blocks_override=2, num_threads=1)


async def _collect(engine: AsyncLLM, rid: str, prompt, params, stop_after: int | None = None):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
        if stop_after is not None and len(outs) >= stop_after:
            break
    return outs


def test_async_llm_streams_aborts_and_frees_blocks(model_dir):
    async def main():
        engine = AsyncLLM(EngineArgs(model=model_dir, **ENGINE_KW))
        try:
            prompts = random_prompts([8, 30, 60, 12, 45], seed=5)
            delta = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            final = SamplingParams(
                temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
            )
            streams = [_collect(engine, f"s{i}", {"prompt_token_ids": p}, delta) for i, p in enumerate(prompts)]
            finals = [_collect(engine, f"f{i}", {"prompt_token_ids": p}, final) for i, p in enumerate(prompts)]
            aborted = _collect(
                engine,
                "early",
                {"prompt_token_ids": prompts[2]},
                SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA),
                stop_after=2,
            )
            results = await asyncio.gather(*streams, *finals, aborted)
            for i in range(len(prompts)):
                streamed = [t for o in results[i] for t in o.outputs[0].token_ids]
                whole = results[len(prompts) + i]
                assert len(whole) == 1 and whole[0].finished
                assert streamed == whole[0].outputs[0].token_ids and len(streamed) == 20
                assert results[i][-1].finished and not any(o.finished for o in results[i][:-1])
            assert not results[-1][-1].finished
            n2 = await _collect(
                engine,
                "n2",
                {"prompt_token_ids": prompts[0]},
                SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY),
            )
            assert len(n2) == 1 and sorted(c.index for c in n2[0].outputs) == [0, 1]
            for _ in range(50):  # the abort reaches the core asynchronously
                stats = await engine.check_invariants()
                if stats["unfinished"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats["in_use"] == 0 and stats["unfinished"] == 0
            assert engine.get_num_unfinished_requests() == 0
            with pytest.raises(ValueError, match="max_tokens"):
                await _collect(engine, "bad", "x", SamplingParams(max_tokens=0))
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_async_llm_dead_engine_fails_waiters(model_dir):
    async def main():
        engine = AsyncLLM(EngineArgs(model=model_dir, max_model_len=512, kv_cache_memory_bytes="16MiB", num_threads=1))
        try:
            params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            gens = [engine.generate({"prompt_token_ids": [5, 6, 7 + i]}, params, f"long{i}") for i in range(8)]
            await gens[0].__anext__()  # the engine is busy now
            os.kill(engine.engine_core.core.proc.pid, signal.SIGKILL)

            async def drain(gen):
                async for _ in gen:
                    pass

            start = time.monotonic()
            for gen in gens:
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(drain(gen), timeout=10)
            assert time.monotonic() - start < 10
            assert engine.dead
            with pytest.raises(EngineDeadError):
                await _collect(engine, "after", "hi", SamplingParams(max_tokens=4))
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_spare_core_becomes_the_engine_it_is_handed(model_dir):
    """SpareCore (the router's): a process that made its imports becomes the engine it is told to be, answers like
    one started for it, and stops with its client; an unused spare exits when closed; a dead one is replaced by a
    fresh process."""
    import zmq

    from pagedllm.engine.core_client import SyncMPClient
    from pagedllm.engine.core_process import CoreProcess, SpareCore

    engine_args = EngineArgs(model=model_dir, **ENGINE_KW).for_engine_core()
    spare = SpareCore()
    client = SyncMPClient(None, engine_args, core=CoreProcess(engine_args, zmq.Context(), spare=spare))
    try:
        assert client.core.proc is spare.proc and not spare.alive()
        assert client.call_utility("check_invariants")["in_use"] == 0
    finally:
        client.shutdown()
    assert spare.proc.wait(30) == 0
    unused = SpareCore()
    unused.close()
    assert unused.proc.returncode == 0
    dead = SpareCore()
    dead.proc.kill()
    dead.proc.wait()
    core = CoreProcess(engine_args, zmq.Context(), spare=dead)
    try:
        assert core.proc is not dead.proc and core.proc.poll() is None
    finally:
        core.terminate()


def test_set_num_threads_shares_the_threads_never_above_start_up(model_dir):
    kw = {**ENGINE_KW, "num_threads": 2}
    with LLM(model_dir, engine_client="mp", **kw) as llm:
        prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 30], seed=4)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert llm.engine_core.call_utility("set_num_threads", 1) == [1]
        # (the tokens may differ in rounding from two threads': only that it runs is checked)
        assert [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == [8, 8]
        assert llm.engine_core.call_utility("set_num_threads", 8) == [2]  # capped at the start-up count
