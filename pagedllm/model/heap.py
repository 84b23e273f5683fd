"""Freed host memory kept for reuse by the process's allocator, so that large activations are not faulted in anew.

Contract. `reuse_freed_memory()` asks glibc's malloc (Linux) to serve every allocation from its heap, never from a
mapping of its own (`M_MMAP_MAX` 0), and to give the heap's free top back to the OS only beyond 1 GiB
(`M_TRIM_THRESHOLD`). It returns whether the allocator took both settings; on another C library or system it changes
nothing and returns False. It is for a process that runs a model (the engine core's worker, or an in-process
`LLM`), called once the weights are loaded, so that what loading frees is still given back.

Why: glibc maps each block above its mmap threshold (at most 32 MiB) by itself and unmaps it when freed. A prefill
chunk's large activations are that size (gate|up of 2,048 tokens of Qwen2.5-0.5B: 80 MB, 40 MB after SiLU), so every
layer of every chunk paid for faulting in and zeroing those pages: 64 prompts of 128 tokens took 14.3 s to prefill
on an Intel Xeon (2 cores), 8.4 s with freed memory reused (bench/RESULTS.md). The price is that the process keeps
the largest activations of a step resident between steps, as a GPU engine's caching allocator does, and a few copies
of them at first: torch allocates with posix_memalign, which asks for a little more than the block, so a freed block
that did not merge into the heap's top cannot serve the next equal one; the heap grows a few times (five at most in
tests/model/test_heap.py) before its free blocks coalesce and every allocation reuses them.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30


def reuse_freed_memory() -> bool:
    """Keep freed memory in the process's heap (see the module's contract). True when glibc took the settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's libc: glibc has mallopt, musl does not
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
