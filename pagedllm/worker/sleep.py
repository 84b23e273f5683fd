"""Sleep mode of one worker: its weights and KV cache leave memory while the process and every object stay.

Contract. `MemorySleeper(model, kv_tensors)` (`kv_tensors()`: the KV cache's tensors) finds, at each `sleep()`,
the memory the model's weights live in (every tensor reachable from the model's modules: parameters, buffers, packed
panels, quantized matrices, oneDNN's packed copies, LoRA slots) and, apart from it, the KV cache tensors. `sleep()`
writes the weights' bytes to an unlinked temporary file (page cache: memory the kernel may reclaim, not this
process's), then gives every whole page of the weights and of the KV cache back to the system
(`madvise(MADV_DONTNEED)`) and trims the heap. `wake_up()` reads the weights back into the same addresses; the KV
cache reads as zeros (its contents are gone: the caller resets the prefix cache).
Nothing is reallocated, so every pointer to the weights stays valid: the native quantized matrices and the fused
decoder hold raw addresses of them. Between `sleep()` and `wake_up()` nothing may run the model. `close()` drops
the file.

Why addresses and not tensors: the kernels' objects (QuantMatrix, the fused decoder) keep pointers into the weight
arenas, so replacing tensors would leave them dangling; giving pages back and writing them again later keeps every
address. Only whole pages inside an allocation are dropped: the partial pages at its ends may hold other heap
blocks, and stay (a few KiB per tensor).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.config import cache_dir
from pagedllm.model.heap import trim_heap

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4  # linux/mman.h
_CHUNK = 1 << 30  # bytes per read or write call (Linux moves at most ~2 GiB per call)
PAGE = mmap.PAGESIZE


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def tensor_span(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the whole allocation a tensor lives in (an opaque oneDNN tensor: its own buffer), or None
    for an empty or unaddressable one."""
    try:
        storage = t.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        try:  # oneDNN's packed weights (layout _mkldnn) have no storage; torch exposes their buffer this way
            address, nbytes = int(torch.ops.mkldnn.data_ptr(t)), int(torch.ops.mkldnn._nbytes(t))
        except (RuntimeError, AttributeError, TypeError):
            return None
    if t.device.type != "cpu" or address == 0 or nbytes == 0:
        return None
    return address, nbytes


def _tensors(value: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor inside `value`: itself, the items of containers, the attributes of pagedllm's own objects
    (quantized parts, panels, LoRA slots); nn.Modules are not entered (the caller walks each module)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _tensors(item, seen)
    elif not isinstance(value, nn.Module) and type(value).__module__.startswith("pagedllm"):
        fields = getattr(value, "__dict__", None)
        if fields is None:  # a slots dataclass
            fields = {name: getattr(value, name, None) for name in getattr(type(value), "__slots__", ())}
        yield from _tensors(fields, seen)


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a model's modules hold: parameters, buffers and every tensor-valued attribute."""
    seen: set[int] = set()
    for module in model.modules():
        yield from _tensors(vars(module), seen)


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, bytes) ranges sorted and merged where they overlap or touch."""
    merged: list[list[int]] = []
    for start, size in sorted(spans):
        end = start + size
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def whole_pages(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages inside each range (address, bytes); ranges without one are left out."""
    out = []
    for start, size in spans:
        first = -(-start // PAGE) * PAGE
        last = (start + size) // PAGE * PAGE
        if last > first:
            out.append((first, last - first))
    return out


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class MemorySleeper:
    def __init__(self, model: nn.Module, kv_tensors: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        self.model = model
        self.kv_tensors = kv_tensors
        self.weights: list[tuple[int, int]] = []
        self.kv: list[tuple[int, int]] = []
        self._file: Any = None
        self._saved: list[tuple[int, int]] | None = None  # the spans the file holds, once wholly written
        self.asleep = False

    def _find(self) -> None:
        """The page-aligned interiors of the weights' and the KV cache's memory, found again at every sleep (an
        adapter loaded since, or a buffer replaced, lives elsewhere now)."""
        kv = merge_spans(s for s in (tensor_span(t) for t in self.kv_tensors()) if s is not None)
        writable = _writable_mappings()
        weights = []
        for span in {s for s in (tensor_span(t) for t in model_tensors(self.model)) if s is not None}:
            # Not the KV cache (dropped, never saved), nor memory this process cannot write back (a read-only file
            # mapping: its pages return from the file by themselves).
            if not _inside(span, kv) and (writable is None or _inside(span, writable)):
                weights.append(span)
        self.weights = whole_pages(merge_spans(weights))
        self.kv = whole_pages(kv)

    @property
    def weight_bytes(self) -> int:
        return sum(size for _, size in self.weights)

    @property
    def kv_bytes(self) -> int:
        return sum(size for _, size in self.kv)

    def sleep(self, rewrite: bool = True) -> None:
        """Weights to the file, then weights' and KV cache's pages back to the system. With `rewrite` False the file
        is not written again when it holds these very spans already (the caller knows no weight changed since)."""
        if self.asleep:
            return
        start = time.perf_counter()
        self._find()
        kept = not rewrite and self._file is not None and self.weights == self._saved
        if self._file is None:  # kept from one sleep to the next: rewriting cached pages is cheaper than new ones
            self._file = _open_file()
        offset = 0
        if not kept:
            self._saved = None  # a write that fails half-way leaves no file to trust
            for address, size in self.weights:
                _write_all(self._file.fileno(), _view(address, size), offset)
                offset += size
            self._saved = list(self.weights)
        for address, size in self.weights + self.kv:
            _dontneed(address, size)
        trim_heap()
        self.asleep = True
        logger.info(
            "asleep: %.0f MiB of weights %s aside, %.0f MiB of weights and KV cache freed in %.2f s",
            self.weight_bytes / 2**20, "kept" if kept else "written", (self.weight_bytes + self.kv_bytes) / 2**20,
            time.perf_counter() - start,
        )  # fmt: skip

    def wake_up(self) -> None:
        """Read the weights back where they were; the KV cache pages come back (zeros) as they are written."""
        if not self.asleep:
            return
        start = time.perf_counter()
        offset = 0
        for address, size in self.weights:
            _read_all(self._file.fileno(), _view(address, size), offset)
            offset += size
        self.asleep = False
        logger.info(
            "awake: %.0f MiB of weights read back in %.2f s", self.weight_bytes / 2**20, time.perf_counter() - start
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _inside(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, size = span
    return any(s <= start and start + size <= s + n for s, n in spans)


def _writable_mappings() -> list[tuple[int, int]] | None:
    """(address, bytes) of this process's writable private mappings (/proc/self/maps), merged; None where unknown."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    spans = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[1].startswith("rw") and fields[1][3] == "p":
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end - start))
    return merge_spans(spans)


def _open_file() -> Any:
    """An unlinked temporary file (gone with the process, however it ends) on a disk-backed folder where possible:
    the page cache holds it, which the kernel may reclaim, unlike a tmpfs."""
    folder = os.path.join(cache_dir(), "sleep")
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        return tempfile.TemporaryFile(dir=folder)
    return tempfile.TemporaryFile()


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _CHUNK], offset + done)


def _read_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.preadv(fd, [data[done : done + _CHUNK]], offset + done)
        if n <= 0:
            raise OSError(f"sleep file ended at byte {offset + done} of the weights")
        done += n


def _dontneed(address: int, size: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    madvise = _libc().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(address, size, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {size} bytes failed")
