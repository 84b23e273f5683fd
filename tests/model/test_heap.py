"""Freed host memory kept for reuse (pagedllm/model/heap.py): after `reuse_freed_memory`, a large tensor allocated
again where an equal one was freed is not faulted in anew. Each case runs in a fresh interpreter, since the setting
is for the whole process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")

MB = 1 << 20
SIZE = 96 * MB  # above glibc's largest mmap threshold (32 MiB): without reuse, a mapping of its own each time

ROUNDS = 16
SCRIPT = f"""ROUNDS = {ROUNDS}
import resource, sys, torch
from pagedllm.model.heap import reuse_freed_memory
took = reuse_freed_memory() if sys.argv[1] == "reuse" else None
def faults_of_one():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty({SIZE} // 4)
    t.fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one()  # the first time, every page is new either way
print(took, *(faults_of_one() for _ in range(ROUNDS)))
"""


def _faults(mode: str) -> tuple[str, list[int]]:
    """What reuse_freed_memory returned (None: not called), and the page faults of ROUNDS allocations after the
    first."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return out[0], [int(n) for n in out[1:]]


def _thp_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@linux
def test_freed_memory_is_reused_without_faults() -> None:
    pages = SIZE // 4096
    took, reused = _faults("reuse")
    assert took == "True"
    # torch allocates with posix_memalign, which asks glibc for a little more than the block: a freed block that did
    # not merge into the heap's top cannot serve the next one, so the heap grows a few times before its free blocks
    # coalesce; after that every allocation reuses them. Without the setting every one faults in anew.
    assert sum(reused) < 0.6 * pages * ROUNDS, f"page faults of a reused {SIZE // MB} MiB tensor: {reused}"
    assert reused[-1] < pages // 20, reused
    # The control: glibc's default maps and unmaps such a block each time, so its pages fault in again (unless
    # transparent huge pages are "always", which backs the mapping with few large pages).
    took, fresh = _faults("default")
    assert took == "None"
    if not _thp_always():
        assert all(n > pages // 2 for n in fresh), f"page faults without reuse: {fresh}, fewer than the control needs"


def test_off_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.model import heap

    monkeypatch.setattr(heap.sys, "platform", "darwin")
    assert heap.reuse_freed_memory() is False
