"""Running one function in several spawned processes, one per rank, and collecting what each returns.

`run_in_processes(target, world, *args)` calls `target(rank, world, results, *args)` in `world` processes started
with the "spawn" method (nothing of the caller is forked) and returns `(ok, value)` per rank, in rank order: the
return value, or the traceback text of an exception. `results` is the queue the answers travel on; a target may
put its own `(rank, True, value)` there first (to report before it dies). A rank that has not answered within
`timeout` seconds is a `TimeoutError` naming it. Every process is stopped before this returns. Used by the
all-reduce benchmark and its tests.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any


def _entry(target: Callable[..., Any], rank: int, world: int, results: Any, args: tuple, threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        results.put((rank, True, target(rank, world, results, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_in_processes(
    target: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0, threads: int | None = 1
) -> list[tuple[bool, Any]]:
    """See the module docstring; `threads`: torch threads of each process (None: leave torch's default)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, results, args, threads), daemon=True) for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} did not answer in time") from None
            got.setdefault(rank, (ok, value))
        return [got[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=15)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
