"""The tensor-parallel sum between the ranks of one machine, through POSIX shared memory instead of gloo's sockets.

Contract.
* `available()` says whether the native all-reduce can be used here (pagedllm._C built, from the current sources, on
  a platform with POSIX shared memory); `unavailable_reason()` says why not. This module imports without the
  extension: callers check `available()` and otherwise keep gloo's `dist.all_reduce` (the fallback is theirs, see
  parallel_state.TensorParallelGroup).
* `ShmAllReduce.create(group_name, rank, world_size, max_floats, group=..., barrier=..., timeout_s=...)` is
  collective: every rank of the group calls it, all on one machine (the caller's job to know). Rank 0 creates the
  segment, the others open it, and all wait until everyone is in; the segment's name is then unlinked, so nothing
  is left in /dev/shm however the processes end. How the ranks meet:
  - `group` (a torch.distributed process group, e.g. the workers' gloo group): rank 0 creates the segment under a
    fresh random name, which it broadcasts with its success or its error, so two groups of one `group_name` on one
    machine never meet and a failure of rank 0 is every rank's error at once;
  - else `barrier` (any callable every rank calls, e.g. `lambda: dist.barrier(group)`): rank 0 creates, the
    barrier, the others open; the name is `group_name`'s alone, so it must be unique on the machine;
  - else the others poll for the segment until `timeout_s` (the same uniqueness applies).
  A rank that cannot join raises RuntimeError; a peer that never joins is a RuntimeError within `timeout_s`.
* `all_reduce(t)`: t (a dense contiguous float32 CPU tensor that does not require grad; anything else is a
  RuntimeError naming what is wrong) becomes the sum of every rank's t, in place, and is returned. Every rank must
  call it with the same number of elements, in the same order of calls. Each rank gets the same bits (the ranks'
  values are added in rank order everywhere). Vectors longer than `max_floats` go through in chunks of it. A peer that
  does not arrive within `timeout_s`, or that closed or failed, makes the call raise RuntimeError; the object is
  then broken (every later call raises the same error).
* `hook()` -> (fn, ctx): the C function pointer and context as integers, for the fused decoder's all-reduce hook
  (csrc/cpu/kernels.h, AllReduceFn); valid while this object lives. A call through it cannot raise: `check()`
  afterwards raises its error.
* `close()` leaves the group (peers still waiting for this rank fail at once rather than at the timeout);
  idempotent, also on garbage collection and as a context manager.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_MAX_FLOATS = 1 << 16  # 256 KiB a slot: a decode step's activations in one piece, a prefill's in a few
DEFAULT_TIMEOUT_S = 30.0
_GROUP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _native() -> Any:
    """pagedllm._C if it has a usable ShmAllReduce, else raises RuntimeError saying why."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the shared-memory all-reduce needs Linux (POSIX shared memory), not {sys.platform}")
    try:
        import pagedllm._C as _C
    except ImportError as exc:
        raise RuntimeError(
            f"the native extension pagedllm._C is not built ({exc}); build it with `make setup` or `pip install -e .`"
        ) from None
    if not hasattr(_C, "ShmAllReduce"):
        raise RuntimeError("pagedllm._C predates the shared-memory all-reduce: rebuild it (`pip install -e .`)")
    from pagedllm.csrc.source_hash import source_hash

    built, current = getattr(_C, "source_hash", None), source_hash()
    if current is not None and built != current:
        raise RuntimeError(
            f"pagedllm._C was built from other sources (build {built}, sources {current}): rebuild it with "
            "`make setup` or `pip install -e .`"
        )
    return _C


def unavailable_reason() -> str | None:
    """Why the shared-memory all-reduce cannot be used here, or None when it can."""
    try:
        _native()
    except RuntimeError as exc:
        return str(exc)
    return None


def available() -> bool:
    """Whether the shared-memory all-reduce can be used here (`unavailable_reason()` says why not)."""
    return unavailable_reason() is None


def segment_name(group_name: str, nonce: str = "") -> str:
    """The POSIX shared-memory name of a group: per user (another user's segment of the same name cannot be
    opened anyway), then the group's name and the nonce rank 0 broadcast, if any."""
    if not _GROUP_NAME.fullmatch(group_name):
        raise ValueError(f"group_name must be 1 to 64 of [A-Za-z0-9_.-], got {group_name!r}")
    return f"/pagedllm-ar-{os.getuid()}-{group_name}" + (f"-{nonce}" if nonce else "")


class ShmAllReduce:
    """One rank's end of a shared-memory all-reduce group (see the module docstring); build it with `create`."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @classmethod
    def create(
        cls,
        group_name: str,
        rank: int,
        world_size: int,
        max_floats: int = DEFAULT_MAX_FLOATS,
        *,
        group: Any = None,
        barrier: Callable[[], None] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> ShmAllReduce:
        """Join the group `group_name` as `rank` of `world_size` (collective; see the module docstring)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        if max_floats < 1:
            raise ValueError(f"max_floats must be at least 1, got {max_floats}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if group is not None and barrier is not None:
            raise ValueError("pass group or barrier, not both")
        segment_name(group_name)  # a bad name is every rank's ValueError, before anyone waits
        C = _native()
        if group is not None:
            native = cls._create_over_group(C, group, group_name, rank, world_size, max_floats, timeout_s)
        else:
            name = segment_name(group_name)
            native = None
            error: BaseException | None = None
            if rank == 0:
                try:
                    native = C.ShmAllReduce(name, 0, world_size, max_floats, True, timeout_s)
                except RuntimeError as exc:  # still meet the others at the barrier, so that they do not hang there
                    error = exc
            if barrier is not None:
                barrier()
            if error is not None:
                raise error
            if rank != 0:
                native = C.ShmAllReduce(name, rank, world_size, max_floats, False, timeout_s)
        try:
            native.wait_for_peers()
        except BaseException:
            native.close()
            raise
        return cls(native)

    @staticmethod
    def _create_over_group(
        C: Any, group: Any, group_name: str, rank: int, world_size: int, max_floats: int, timeout_s: float
    ) -> Any:
        import torch.distributed as dist

        if dist.get_rank(group) != rank or dist.get_world_size(group) != world_size:
            raise ValueError(
                f"rank {rank} of {world_size} does not match the process group's "
                f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
            )
        # [segment name, rank 0's error or None]: one broadcast makes the name unique and fails every rank at once.
        message: list[Any] = [None, None]
        native = None
        if rank == 0:
            message[0] = segment_name(group_name, secrets.token_hex(6))
            try:
                native = C.ShmAllReduce(message[0], 0, world_size, max_floats, True, timeout_s)
            except RuntimeError as exc:
                message[1] = str(exc)
        dist.broadcast_object_list(message, group=group, group_src=0)
        if message[1] is not None:
            raise RuntimeError(
                message[1] if rank == 0 else f"rank 0 could not create the shared-memory all-reduce: {message[1]}"
            )
        if rank != 0:
            native = C.ShmAllReduce(message[0], rank, world_size, max_floats, False, timeout_s)
        return native

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t = the sum of every rank's t, in place; returns t."""
        return self._native.all_reduce(t)

    def hook(self) -> tuple[int, int]:
        """(fn, ctx) for the fused decoder's AllReduceFn; valid while this object lives."""
        return self._native.hook()

    def check(self) -> None:
        """Raise RuntimeError if a call (through `hook()` too) failed, or if this object is closed."""
        self._native.check()

    def close(self) -> None:
        """Leave the group; idempotent."""
        self._native.close()

    @property
    def error(self) -> str | None:
        """The error that broke this object (a failed call, or closing it), None while it works."""
        return self._native.error

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def max_floats(self) -> int:
        return self._native.max_floats

    @property
    def timeout_s(self) -> float:
        return self._native.timeout_s

    @property
    def name(self) -> str:
        return self._native.name

    def __enter__(self) -> ShmAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self.error else "open")
        return f"ShmAllReduce({self.name!r}, rank={self.rank}, world_size={self.world_size}, {state})"
