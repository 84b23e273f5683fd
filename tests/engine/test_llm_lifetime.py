"""An `LLM` lives as long as its last reference: dropping it stops its engine core and the core's worker processes
within 5 s (no reference cycle keeps it: the test runs with the garbage collector off), so a script that builds
LLMs one after the other and drops each holds one engine at a time; the in-process client stops its workers too."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from tests.model_utils import make_tiny_model

TINY = dict(max_model_len=256, kv_cache_memory_bytes="16MiB", num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited, only not reaped yet
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still running after `timeout` seconds (none, when all stopped in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM")


@pytest.mark.timeout(300)
def test_dropping_the_last_reference_stops_the_engine_core() -> None:
    """The default model on the default (multiprocess) client: `del llm` alone, with the collector off, frees the
    LLM at once (no cycle holds it) and its engine-core process is gone within 5 s."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(max_model_len=256, kv_cache_memory_bytes="64MiB")
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        pid = llm.engine_core.core.proc.pid
        assert not _gone(pid)
        ref = weakref.ref(llm)
        del llm
        assert ref() is None, "a reference cycle keeps the LLM alive"
        assert _wait_gone([pid]) == [], "the engine core outlived its LLM"
    finally:
        gc.enable()


@pytest.mark.timeout(300)
def test_llms_built_one_after_another_hold_one_engine_at_a_time(model_dir: str) -> None:
    earlier: list[int] = []
    for i in range(3):
        llm = LLM(model_dir, **TINY)
        pid = llm.engine_core.core.proc.pid
        assert all(_gone(p) for p in earlier), f"LLM {i}: an engine of a dropped LLM still runs"
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
        earlier.append(pid)
        del llm
        assert _wait_gone([pid]) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_client", ["mp", "inproc"])
def test_dropping_an_llm_stops_its_workers(model_dir: str, engine_client: str) -> None:
    """Two tensor-parallel ranks (worker processes of the multiprocess executor): dropping the LLM stops them, from
    the engine-core process (mp) or from this one (inproc, whose client stops its engine when dropped)."""
    llm = LLM(model_dir, engine_client=engine_client, tensor_parallel_size=2, **TINY)
    workers = llm.engine_core.call_utility("collective_rpc", "process_id")
    assert len(set(workers)) == 2 and os.getpid() not in workers
    pids = workers + ([llm.engine_core.core.proc.pid] if engine_client == "mp" else [])
    del llm
    gc.collect()  # the in-process engine's own objects may hold cycles; the client's finalizer stops it regardless
    assert _wait_gone(pids) == [], "worker processes outlived their LLM"
