"""Sleep mode of one worker: its weights and KV cache leave memory while the process and every object stay.

Contract. `MemorySleeper(model, kv_tensors)` (`kv_tensors()`: the KV cache's tensors) finds, at each `sleep()`,
the memory the model's weights live in (every tensor reachable from the model's modules: parameters, buffers, packed
panels, quantized matrices, oneDNN's packed copies, LoRA slots) and, apart from it, the KV cache tensors. Scratch
buffers reachable from the model (a class with `sleep_scratch = True`) are not weights.
* Weights in hugepages' own mappings (the arenas decode streams: most of a model's bytes) are written to an unlinked
  temporary file at their first sleep and the file is mapped over them in place (`mmap(MAP_SHARED | MAP_FIXED)`):
  from then on they live in the page cache (memory the kernel may reclaim, writing it to the file first), and a
  later write to them lands in the file by itself. `wake_up()` maps them back (`MADV_POPULATE_READ`; where the
  kernel lacks it they come back as the model reads them): nothing is copied. Only new ranges are written at a
  later sleep; a range of the file's that holds no weight any more becomes anonymous memory again, contents kept.
* Every other weight (heap memory, which the allocator hands out again once freed: no file may stay mapped there)
  is written to a second file at every sleep and read back by `wake_up()`.
* Every sleep then gives the weights' and the KV cache's pages back (`madvise(MADV_DONTNEED)`) and trims the heap.
  The KV cache reads as zeros after it (its contents are gone: the caller resets the prefix cache).
Between `sleep()` and `wake_up()` nothing may run the model. `close()` (before the model is dropped) turns the
file's ranges back into anonymous memory, contents kept, and drops the files.

Why addresses and not tensors: the kernels' objects (QuantMatrix, the fused decoder) keep pointers into the weight
arenas, so replacing tensors would leave them dangling; mapping the file where they are keeps every address. Only
whole pages inside an allocation are dropped: the partial pages at its ends may hold other heap blocks, and stay (a
few KiB per tensor). Each range sits in the file at an offset congruent to its address modulo 2 MiB, so that a
kernel that keeps large folios in the page cache maps a huge-page arena with huge pages again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
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
from pagedllm.model import hugepages
from pagedllm.model.heap import trim_heap

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4  # linux/mman.h
_MADV_POPULATE_READ = 22  # Linux 5.14
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 0x1, 0x2
_HUGE = 2 << 20  # file offsets keep each range's place within a 2 MiB page
_CHUNK = 1 << 30  # bytes per read or write call (Linux moves at most ~2 GiB per call)
PAGE = mmap.PAGESIZE
_LINUX = sys.platform.startswith("linux")


@functools.cache
def _libc() -> Any:
    """The process's libc, with the prototypes of the calls used here."""
    libc = ctypes.CDLL(None, use_errno=True)
    void_p, size_t, int_ = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    libc.madvise.argtypes = [void_p, size_t, int_]
    libc.mmap.restype = void_p
    libc.mmap.argtypes = [void_p, size_t, int_, int_, int_, ctypes.c_long]
    libc.mremap.restype = void_p
    libc.mremap.argtypes = [void_p, size_t, size_t, int_, void_p]
    libc.munmap.argtypes = [void_p, size_t]
    return libc


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
    if id(value) in seen or getattr(type(value), "sleep_scratch", False):  # scratch buffers are no weights
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
        self.mapped: list[tuple[int, int]] = []  # the weights in hugepages' own mappings: the file mapped over them
        self.copied: list[tuple[int, int]] = []  # the others (heap memory): written aside and read back
        self.kv: list[tuple[int, int]] = []
        self._file: Any = None  # mapped over `mapped`
        self._copies: Any = None  # holds `copied` while asleep
        # The file as /proc/self/maps names it, (device, inode), learnt from its first mapping (on an overlay file
        # system fstat names another device than the maps do).
        self._inode: tuple[int, int] | None = None
        self._end = 0  # the file's length
        self.asleep = False

    def _find(self) -> None:
        """The page-aligned interiors of the weights' and the KV cache's memory, found again at every sleep (an
        adapter loaded since, or a buffer replaced, lives elsewhere now)."""
        kv = merge_spans(s for s in (tensor_span(t) for t in self.kv_tensors()) if s is not None)
        writable = _writable_mappings(self._inode)
        weights = []
        for span in {s for s in (tensor_span(t) for t in model_tensors(self.model)) if s is not None}:
            # Not the KV cache (dropped, never saved), nor memory this process cannot write back (a read-only file
            # mapping: its pages return from the file by themselves; another process's shared memory).
            if not _inside(span, kv) and (writable is None or _inside(span, writable)):
                weights.append(span)
        self.weights = whole_pages(merge_spans(weights))
        own = merge_spans(hugepages.own_mappings())
        self.mapped = [w for w in self.weights if _inside(w, own)]
        self.copied = [w for w in self.weights if not _inside(w, own)]
        self.kv = whole_pages(kv)

    @property
    def weight_bytes(self) -> int:
        return sum(size for _, size in self.weights)

    @property
    def kv_bytes(self) -> int:
        return sum(size for _, size in self.kv)

    def sleep(self) -> None:
        """Weights of hugepages' mappings not yet in the file to it (mapped over them), the others to the copy file,
        then the weights' and the KV cache's pages back to the system."""
        if self.asleep:
            return
        start = time.perf_counter()
        self._find()
        if not _LINUX:  # the memory stays (nothing here knows another system's flags); the state still holds
            self.asleep = True
            return
        if self._file is None:
            self._file, self._copies = _open_file(), _open_file()
        # What the file is mapped over now (the kernel's word), less this sleep's weights: memory of a mapping that
        # holds no weight any more becomes anonymous again, contents kept (no allocator works in these mappings,
        # and one that is unmapped took the file's pages with it).
        mapped = _file_mappings(self._inode)
        for address, size in subtract_spans(mapped, self.mapped):
            _to_anonymous(address, size)
        new = subtract_spans(self.mapped, mapped)
        for address, size in new:
            # Written at an offset congruent to the address modulo 2 MiB (huge pages map again), then mapped.
            offset = -(-self._end // _HUGE) * _HUGE + address % _HUGE
            _write_all(self._file.fileno(), _view(address, size), offset)
            _map_file(address, size, self._file.fileno(), offset)
            self._end = offset + size
            if self._inode is None:
                self._inode = _identity_at(address)
        offset = 0
        for address, size in self.copied:  # heap memory: written each time (an adapter slot may have changed)
            _write_all(self._copies.fileno(), _view(address, size), offset)
            offset += size
        for address, size in self.weights + self.kv:
            _madvise(address, size, _MADV_DONTNEED)
        trim_heap()
        self.asleep = True
        logger.info(
            "asleep: %.0f MiB of weights in the page cache (%.0f MiB mapped, %.0f MiB of it written now; %.0f MiB "
            "copied), %.0f MiB of KV cache freed in %.2f s", self.weight_bytes / 2**20,
            sum(n for _, n in self.mapped) / 2**20, sum(n for _, n in new) / 2**20,
            sum(n for _, n in self.copied) / 2**20, self.kv_bytes / 2**20, time.perf_counter() - start,
        )  # fmt: skip

    def wake_up(self) -> None:
        """The mapped weights' pages mapped back from the page cache, the copied ones read back; the KV cache's
        pages come back (zeros) as they are written."""
        if not self.asleep:
            return
        start = time.perf_counter()
        for address, size in self.mapped:
            if not _madvise(address, size, _MADV_POPULATE_READ, check=False):
                break  # an older kernel: the pages come back as the model reads them
        offset = 0
        for address, size in self.copied if self._copies is not None else ():
            _read_all(self._copies.fileno(), _view(address, size), offset)
            offset += size
        self.asleep = False
        logger.info("awake: %.0f MiB of weights back in %.2f s", self.weight_bytes / 2**20, time.perf_counter() - start)

    def close(self) -> None:
        """Every range still mapped from the file becomes anonymous memory again, its contents kept (a tensor of
        the model may outlive it), and the files go."""
        if self._file is None:
            return
        for address, size in _file_mappings(self._inode):
            _to_anonymous(address, size)
        for f in (self._file, self._copies):
            f.close()
        self._file = self._copies = None


def subtract_spans(spans: Iterable[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the (address, bytes) ranges `spans` outside the merged, sorted ranges `minus`."""
    out = []
    for start, size in spans:
        pos, end = start, start + size
        for m_start, m_size in minus:
            m_end = m_start + m_size
            if m_end <= pos or m_start >= end:
                continue
            if m_start > pos:
                out.append((pos, m_start - pos))
            pos = max(pos, m_end)
            if pos >= end:
                break
        if pos < end:
            out.append((pos, end - pos))
    return out


def _inside(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, size = span
    return any(s <= start and start + size <= s + n for s, n in spans)


def _maps() -> list[tuple[int, int, list[str]]] | None:
    """(start, end, fields) of each line of /proc/self/maps; None where unknown."""
    try:
        with open("/proc/self/maps") as f:
            lines = [line.split() for line in f.read().splitlines()]
    except OSError:
        return None
    return [(*(int(x, 16) for x in fields[0].split("-")), fields) for fields in lines]  # type: ignore[misc]


def _inode_of(fields: list[str]) -> tuple[int, int] | None:
    """(device, inode) of a /proc/self/maps line's file."""
    if len(fields) < 5:
        return None
    major, minor = (int(x, 16) for x in fields[3].split(":"))
    return os.makedev(major, minor), int(fields[4])


def _writable_mappings(own: tuple[int, int] | None = None) -> list[tuple[int, int]] | None:
    """(address, bytes) of this process's writable private mappings and its shared mappings of the file `own`
    (/proc/self/maps), merged; None where unknown."""
    lines = _maps()
    if lines is None:
        return None
    spans = []
    for start, end, fields in lines:
        if len(fields) >= 2 and fields[1].startswith("rw"):
            if fields[1][3] == "p" or (own is not None and _inode_of(fields) == own):
                spans.append((start, end - start))
    return merge_spans(spans)


def _file_mappings(own: tuple[int, int] | None) -> list[tuple[int, int]]:
    """(address, bytes) of this process's mappings of the file `own`, merged."""
    if own is None:
        return []
    return merge_spans((start, end - start) for start, end, fields in _maps() or () if _inode_of(fields) == own)


def _identity_at(address: int) -> tuple[int, int] | None:
    """(device, inode) of the file mapped at `address`, as /proc/self/maps names it."""
    return next((_inode_of(fields) for start, end, fields in _maps() or () if start <= address < end), None)


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


def _madvise(address: int, size: int, advice: int, check: bool = True) -> bool:
    """madvise(2) on Linux (elsewhere nothing happens); False where the kernel refused it (OSError if `check`)."""
    if not _LINUX:
        return False
    if _libc().madvise(address, size, advice) != 0:
        if check:
            raise OSError(ctypes.get_errno(), f"madvise({advice}) of {size} bytes failed")
        return False
    return True


def _map_file(address: int, size: int, fd: int, offset: int) -> None:
    """The file's bytes from `offset` mapped (shared) over [address, address + size), in place of what was there."""
    if _libc().mmap(address, size, _PROT_READ_WRITE, _MAP_SHARED | _MAP_FIXED, fd, offset) != address:
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes at {address:#x} failed")


def _to_anonymous(address: int, size: int) -> None:
    """Anonymous memory over [address, address + size) in place of the file's, holding what the file held: copied
    into a fresh mapping the kernel places elsewhere, which `mremap` then moves over the range at once. (A copy on the
    heap could land inside the range itself, freed memory being reused: then it would be overwritten mid-way.)"""
    libc = _libc()
    fresh = libc.mmap(None, size, _PROT_READ_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if fresh in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
    ctypes.memmove(fresh, address, size)
    if libc.mremap(fresh, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) != address:
        errno = ctypes.get_errno()
        libc.munmap(fresh, size)
        raise OSError(errno, f"mremap of {size} bytes to {address:#x} failed")
