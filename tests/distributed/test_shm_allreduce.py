"""The shared-memory all-reduce (pagedllm/distributed/shm_allreduce.py, csrc/cpu/shm_allreduce.cpp) between real
processes: sums exact and the same bits on every rank (n = 1, 576, longer than a slot, and 2000 calls in a row of
varying lengths with ranks arriving late at random, against slot reuse), through the Python method and through the
C hook the fused decoder calls; the three ways of meeting (a gloo group, a barrier, polling); nothing left in
/dev/shm; and every failure an error rather than a hang: a peer that never joins, one that dies, one that closed,
lengths that disagree, a duplicate rank, a segment of another shape, tensors it cannot sum, no extension.

Every process a test starts is stopped before it returns (spawned ranks are joined, killed if they linger).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from pagedllm.distributed import shm_allreduce
from pagedllm.distributed.net import free_port
from pagedllm.distributed.shm_allreduce import ShmAllReduce, segment_name
from pagedllm.distributed.spawn import run_in_processes

needs_build = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler, so no native extension")
MAX_FLOATS = 1000  # small slots, so that lengths past them are cheap to test


def unique_name() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"


def leftovers(group_name: str) -> list[str]:
    """Segments of this group still in /dev/shm (the creator unlinks the name once every rank is in)."""
    prefix = segment_name(group_name)[1:]
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)] if os.path.isdir("/dev/shm") else []


# ---- running ranks in their own processes -------------------------------------------------------------------------


def run_ranks(target: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """target(rank, world, results_queue, *args) in `world` spawned processes (one torch thread each); its return
    values in rank order (AssertionError with the traceback of a rank that raised, or naming ranks that did not
    answer). Every process is stopped before this returns."""
    try:
        answers = run_in_processes(target, world, *args, timeout=timeout)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None
    failed = {r: v for r, (ok, v) in enumerate(answers) if not ok}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
    return [value for _, value in answers]


def _inputs(call: int, n: int, world: int) -> list[torch.Tensor]:
    """Every rank's input of one call (each rank makes all of them, to know the expected sum)."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(call * 1009 + r)) for r in range(world)]


def _lengths() -> list[int]:
    fixed = [1, 576, MAX_FLOATS, MAX_FLOATS + 1, 2 * MAX_FLOATS + 576]
    rng = torch.Generator().manual_seed(7)
    return fixed + torch.randint(1, 2 * MAX_FLOATS, (2000,), generator=rng).tolist()


def _sum_worker(rank: int, world: int, results: Any, group_name: str, mode: str, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if mode in ("group", "barrier"):
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        kwargs = {"group": dist.group.WORLD} if mode == "group" else {"barrier": dist.barrier}
    shm = ShmAllReduce.create(group_name, rank, world, MAX_FLOATS, timeout_s=30.0, **kwargs)
    digest = hashlib.sha256()
    jitter = torch.Generator().manual_seed(100 + rank)
    try:
        for call, n in enumerate(_lengths()):
            inputs = _inputs(call, n, world)
            expected = inputs[0].clone()
            for x in inputs[1:]:
                expected += x  # rank order, as the all-reduce adds
            if torch.rand(1, generator=jitter).item() < 0.05:  # arrive late now and then: slot reuse must wait
                time.sleep(torch.rand(1, generator=jitter).item() * 2e-4)
            t = inputs[rank].clone()
            assert shm.all_reduce(t) is t
            assert torch.equal(t.view(torch.int32), expected.view(torch.int32)), f"call {call} (n={n}) is not the sum"
            digest.update(t.numpy().tobytes())
        # The C hook the fused decoder calls, with the same data on every rank's side.
        fn, ctx = shm.hook()
        hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(fn)
        for call, n in enumerate((576, 3 * MAX_FLOATS - 1), start=10**6):
            inputs = _inputs(call, n, world)
            t = inputs[rank].clone()
            hook(t.data_ptr(), n, ctx)
            shm.check()
            assert torch.equal(t, sum(inputs[1:], inputs[0].clone())), "the hook's result is not the sum"
            digest.update(t.numpy().tobytes())
        return {"digest": digest.hexdigest(), "name": shm.name}
    finally:
        shm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@needs_build
def test_the_extension_is_available_where_it_builds() -> None:
    assert shm_allreduce.available(), shm_allreduce.unavailable_reason()


@needs_build
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "mode"), [(2, "group"), (3, "barrier"), (2, "poll")])
def test_sums_are_exact_and_identical_on_every_rank(world: int, mode: str) -> None:
    group_name = unique_name()
    out = run_ranks(_sum_worker, world, group_name, mode, free_port())
    assert len({o["digest"] for o in out}) == 1, "ranks got different bits"
    assert len({o["name"] for o in out}) == 1
    if mode == "group":  # a random suffix from rank 0
        assert out[0]["name"].startswith(segment_name(group_name) + "-")
    assert leftovers(group_name) == []


# ---- failures are errors --------------------------------------------------------------------------------------------


@needs_build
@pytest.mark.timeout(60)
def test_a_peer_that_never_joins_is_an_error_within_the_timeout() -> None:
    group_name = unique_name()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 did not open the shared-memory segment"):
        ShmAllReduce.create(group_name, 0, 2, 64, timeout_s=0.5)
    with pytest.raises(RuntimeError, match="no shared-memory segment .* its creator did not make it"):
        ShmAllReduce.create(group_name, 1, 2, 64, timeout_s=0.5)
    assert time.monotonic() - start < 20  # the short timeout, not the default 30 s
    assert leftovers(group_name) == []


def _dead_peer_worker(rank: int, world: int, results: Any, group_name: str, how: str, port: int) -> dict[str, Any]:
    if how == "exit":  # a 1 s timeout: meet through gloo first, so that a slow start is not taken for a dead peer
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        shm = ShmAllReduce.create(group_name, rank, world, 64, group=dist.group.WORLD, timeout_s=1.0)
    else:
        shm = ShmAllReduce.create(group_name, rank, world, 64, timeout_s=20.0)
    shm.all_reduce(torch.ones(8))
    if rank == 1:
        if how == "close":
            shm.close()
            return {}
        results.put((rank, True, {}))  # report, then die without closing
        results.close()
        results.join_thread()
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as first:
        shm.all_reduce(torch.ones(8))
    elapsed = time.monotonic() - start
    with pytest.raises(RuntimeError) as again:  # broken: at once, with the same error
        shm.all_reduce(torch.ones(8))
    fn, ctx = shm.hook()
    t = torch.ones(8)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)(fn)(t.data_ptr(), 8, ctx)
    with pytest.raises(RuntimeError) as checked:
        shm.check()
    shm.close()
    return {"error": str(first.value), "again": str(again.value), "checked": str(checked.value), "elapsed": elapsed}


@needs_build
@pytest.mark.timeout(120)
def test_a_peer_that_dies_is_an_error_within_the_timeout() -> None:
    group_name = unique_name()
    out = run_ranks(_dead_peer_worker, 2, group_name, "exit", free_port())[0]
    assert "rank 1" in out["error"] and "did not arrive within 1.0 s" in out["error"]
    assert out["again"] == out["error"] == out["checked"]
    assert out["elapsed"] < 20  # the 1 s timeout, not the default
    assert leftovers(group_name) == []


@needs_build
@pytest.mark.timeout(120)
def test_a_peer_that_closed_is_an_error_at_once() -> None:
    out = run_ranks(_dead_peer_worker, 2, unique_name(), "close", 0)[0]
    assert "rank 1" in out["error"] and "is closed" in out["error"]
    assert out["elapsed"] < 15  # at once, not at the 20 s timeout


def _mismatch_worker(rank: int, world: int, results: Any, group_name: str) -> str:
    with ShmAllReduce.create(group_name, rank, world, 64, timeout_s=20.0) as shm:
        with pytest.raises(RuntimeError, match="different lengths") as err:
            shm.all_reduce(torch.ones(10 + rank))
        return str(err.value)


@needs_build
@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_length_both_fail() -> None:
    run_ranks(_mismatch_worker, 2, unique_name())


@needs_build
def test_a_duplicate_rank_or_a_segment_of_another_shape_is_refused() -> None:
    from pagedllm import _C

    name = segment_name(unique_name())
    creator = _C.ShmAllReduce(name, 0, 2, 64, True, 5.0)
    try:
        with pytest.raises(RuntimeError, match="made for world_size 2, max_floats 64"):
            _C.ShmAllReduce(name, 1, 2, 128, False, 5.0)
        with pytest.raises(RuntimeError, match="made for world_size 2"):
            _C.ShmAllReduce(name, 1, 3, 64, False, 5.0)
        first = _C.ShmAllReduce(name, 1, 2, 64, False, 5.0)
        with pytest.raises(RuntimeError, match="rank 1 is already attached"):
            _C.ShmAllReduce(name, 1, 2, 64, False, 5.0)
        first.close()
    finally:
        creator.close()
    with pytest.raises(RuntimeError, match="no shared-memory segment"):  # the creator unlinked it when it closed
        _C.ShmAllReduce(name, 1, 2, 64, False, 0.2)


@needs_build
def test_one_rank_sums_to_itself_and_refuses_what_it_cannot_sum() -> None:
    with ShmAllReduce.create(unique_name(), 0, 1, 16) as shm:
        t = torch.arange(40, dtype=torch.float32)
        assert torch.equal(shm.all_reduce(t), torch.arange(40, dtype=torch.float32))
        assert shm.all_reduce(torch.empty(0)).numel() == 0
        for bad, what in [
            (torch.ones(4, dtype=torch.float64), "float32"),
            (torch.ones(4, 4).t(), "contiguous"),
            (torch.ones(4, requires_grad=True), "require grad"),
            (torch.ones(4).to_sparse(), "dense"),
        ]:
            with pytest.raises(RuntimeError, match=what):
                shm.all_reduce(bad)
        assert shm.error is None  # a refused tensor does not break the group
        shm.check()
    assert shm.closed and "closed" in (shm.error or "")
    with pytest.raises(RuntimeError, match="closed"):
        shm.all_reduce(torch.ones(4))


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="group_name"):
        ShmAllReduce.create("a/b", 0, 1, 16)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        ShmAllReduce.create("x", 2, 2, 16)
    with pytest.raises(ValueError, match="max_floats"):
        ShmAllReduce.create("x", 0, 1, 0)


def test_without_the_extension_it_is_unavailable_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pagedllm._C", None)  # import fails as if never built
    assert not shm_allreduce.available()
    assert "not built" in (shm_allreduce.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="not built"):
        ShmAllReduce.create(unique_name(), 0, 1, 16)


@needs_build
def test_a_stale_build_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setattr(importlib.import_module("pagedllm.csrc.source_hash"), "source_hash", lambda: "0" * 16)
    assert "built from other sources" in (shm_allreduce.unavailable_reason() or "")
