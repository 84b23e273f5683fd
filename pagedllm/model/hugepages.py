"""Host memory backed by transparent huge pages (2 MiB) for the tensors that decode streams every step.

Contract. `empty(shape, dtype, device)` and `zeros(...)` return an ordinary tensor; on a Linux CPU, when it is at
least one huge page, its memory is a fresh anonymous mapping of its own (zero-filled by the OS page by page on first
touch, so `zeros` costs nothing up front, however large), starts on a 2 MiB boundary and is advised `MADV_HUGEPAGE`
before its first touch, so the kernel backs it with huge pages where transparent huge pages are enabled ("always"
or "madvise"). Anywhere else (other devices, other systems, THP off or refused) they are plain `torch.empty` /
`torch.zeros`: the advice is only ever a hint. `arena(shapes, dtype)` is one such allocation cut into uninitialised
tensors of the given shapes, back to back in that order, each on a 64-byte boundary. `consolidate(tensors)` moves
several tensors (parameters or not) into an arena, in the order given, and rebinds each one's data to its view there
(values unchanged).

Why: single-request decode reads every weight once per token, and with 4 KiB pages every 4 KiB of a streamed
weight costs a TLB miss and restarts the hardware prefetcher. The paged KV cache, read in small blocks scattered
over hundreds of MB, gains nothing measurable, and its huge pages are faulted in while requests run, where the
kernel's direct compaction (THP defrag "madvise") stalled them: it takes `huge=False`, a fresh mapping of normal
pages. Either way it is never touched at startup: a 2 GiB `torch.zeros` took seconds to fault in and clear every
page before the first request.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import weakref
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_mappings: dict[int, int] = {}  # the live mappings of `empty`: address -> bytes
_MADV_HUGEPAGE = 14  # linux/mman.h


def applies(device: torch.device | str) -> bool:
    """Whether huge-page advice can apply to memory on `device` (the CPU, on Linux)."""
    return torch.device(device).type == "cpu" and sys.platform.startswith("linux")


def _advise(address: int, length: int) -> None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # the process's libc
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if madvise(address, length, _MADV_HUGEPAGE) == 0:
            return
        reason = f"errno {ctypes.get_errno()}"
    except (OSError, AttributeError) as exc:  # no libc or no madvise: nothing to advise
        reason = str(exc)
    logger.debug("huge-page advice refused (%s): this memory uses normal pages", reason)


def empty(
    shape: Sequence[int] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu", huge: bool = True
) -> torch.Tensor:
    """An uninitialised tensor, huge-page backed on a Linux CPU when it spans at least one huge page (with `huge`;
    else a fresh mapping of normal pages, still untouched until used)."""
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * int(torch.Size(shape).numel())
    if not applies(device) or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    # A private anonymous mapping of its own, one huge page longer than the whole huge pages it needs, and the tensor
    # starts on the first 2 MiB boundary inside: the advice comes before any page is faulted in, and untouched pages
    # read as zeros. The tensor keeps the mapping alive (torch.frombuffer holds a reference to it).
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # Private, not Python's default MAP_SHARED: shared anonymous memory is shmem, which transparent huge pages do
    # not back unless shmem_enabled allows it (usually "never").
    mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    base = raw.data_ptr()
    _mappings[base] = len(mapping)
    weakref.finalize(mapping, _mappings.pop, base, None)
    start = -base % HUGE_PAGE
    if huge:
        _advise(base + start, span)
    return raw[start : start + nbytes].view(dtype).view(shape)


def own_mappings() -> list[tuple[int, int]]:
    """(address, bytes) of the live mappings `empty` made, sorted. No allocator ever places anything else in them
    (sleep mode may map a file over their pages: worker/sleep.py)."""
    return sorted(_mappings.items())


def zeros(
    shape: Sequence[int] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu", huge: bool = True
) -> torch.Tensor:
    """Like `empty`, filled with zeros (a fresh mapping is, without touching a page; a small tensor is cleared)."""
    shape = tuple(int(s) for s in shape)
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
    if not applies(device) or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(shape, dtype, device, huge)


def arena(
    shapes: Sequence[Sequence[int] | torch.Size], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation from `empty` (1-D) and uninitialised contiguous views of it of the given shapes, back to back in
    that order. Each view starts on a 64-byte boundary (a cache line), as a fresh allocation would."""
    align = max(1, 64 // torch.empty((), dtype=dtype).element_size())
    sizes = [int(torch.Size(tuple(shape)).numel()) for shape in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // align) * align
    block = empty((total,), dtype, device)
    views = [block[offset : offset + size].view(tuple(shape)) for shape, offset, size in zip(shapes, offsets, sizes)]
    return block, views


def consolidate(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Move `params` (tensors of one dtype, on the CPU) into one huge-page arena, back to back in the given order,
    and rebind each one's data to its view there. Returns the arena, or None where nothing moved."""
    params = [p for p in params if p.numel()]
    if not params or not applies(params[0].device):
        return None
    dtype = params[0].dtype
    if any(p.dtype != dtype or not applies(p.device) for p in params):
        raise ValueError("consolidate() needs parameters of one dtype, all on the CPU")
    block, views = arena([p.shape for p in params], dtype)
    for p, view in zip(params, views, strict=True):
        view.copy_(p.data)
        p.data = view
    return block
