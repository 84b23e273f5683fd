"""Host memory backed by transparent huge pages (2 MiB) for the tensors that decode streams every step.

Contract. `empty(shape, dtype, device)` and `zeros(...)` return an ordinary tensor; on a Linux CPU, when it is at
least one huge page, its memory starts on a 2 MiB boundary and is advised `MADV_HUGEPAGE` before its first touch,
so the kernel backs it with huge pages where transparent huge pages are enabled ("always" or "madvise"). Anywhere
else (other devices, other systems, THP off or refused) they are plain `torch.empty` / `torch.zeros`: the advice is
only ever a hint. `consolidate(tensors)` moves several tensors (parameters or not) into one such arena, in the
order given, and rebinds each one's data to its view there (values unchanged).

Why (figures from this 2-core Zen 4 machine, see bench/RESULTS.md): single-request decode reads every weight
once per token, ~540 MB for SmolLM2-135M. With 4 KiB pages every 4 KiB of a streamed weight costs a TLB miss and
restarts the hardware prefetcher. The same native GEMVs over the same weights ran at ~36 GB/s on 4 KiB pages and
~43 GB/s from one huge-page arena laid out in execution order (a batch-1 forward: ~25.8 -> ~18.0 ms in one
back-to-back pair; repeats on this noisy VM showed 5-15 %). The paged KV cache, read in 12 KiB blocks scattered
over hundreds of MB, gains less: ~5-10 % for the decode attention alone, 277 -> 289 tok/s on the uniform
peer workload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_madvise = None
_warned = False


def _madvise_fn():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def applies(device: torch.device | str) -> bool:
    """Whether huge-page advice can apply to memory on `device` (the CPU, on Linux)."""
    return torch.device(device).type == "cpu" and sys.platform.startswith("linux")


def _advise(address: int, length: int) -> None:
    global _warned
    try:
        if _madvise_fn()(address, length, _MADV_HUGEPAGE) == 0:
            return
        reason = f"errno {ctypes.get_errno()}"
    except (OSError, AttributeError) as exc:  # no libc or no madvise: nothing to advise
        reason = str(exc)
    if not _warned:
        _warned = True
        logger.info("transparent huge pages unavailable (%s): weights and KV cache use normal pages", reason)


def empty(shape: Sequence[int] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor, huge-page backed on a Linux CPU when it spans at least one huge page."""
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * int(torch.Size(shape).numel())
    if not applies(device) or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    # Over-allocate by one huge page (beyond the whole huge pages it needs) and start the tensor on the first
    # 2 MiB boundary inside. A fresh allocation this large is an untouched private mapping, so the advice comes
    # before any page is faulted in.
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    base = raw.data_ptr()
    start = -base % HUGE_PAGE
    _advise(base + start, span)
    return raw[start : start + nbytes].view(dtype).view(shape)


def zeros(shape: Sequence[int] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Like `empty`, filled with zeros."""
    if not applies(device):
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    return empty(shape, dtype, device).zero_()


def consolidate(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Move `params` (tensors of one dtype, on the CPU) into one huge-page arena, back to back in the given order,
    and rebind each one's data to its view there. Returns the arena, or None where nothing moved."""
    params = [p for p in params if p.numel()]
    if not params or not applies(params[0].device):
        return None
    dtype = params[0].dtype
    if any(p.dtype != dtype or not applies(p.device) for p in params):
        raise ValueError("consolidate() needs parameters of one dtype, all on the CPU")
    # Each parameter starts on a 64-byte boundary (a cache line), as a fresh allocation would.
    align = max(1, 64 // params[0].element_size())
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() // align) * align
    arena = empty((total,), dtype)
    for p, offset in zip(params, offsets, strict=True):
        view = arena[offset : offset + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
    return arena
