"""One parsed GGUFReader per file per process: the config and the weights both need it. Parsing a file's metadata
with gguf's reader takes seconds for a large vocabulary (5.5 s for Gemma 3's 262k tokens: a numpy view per string);
arrays of more than LAZY_ARRAY_MIN_ITEMS items are skipped over instead (their lengths walked), which takes ~0.1 s.

The reader parses over a plain ndarray view of the file's mapping rather than gguf's np.memmap: it slices the
mapping once or twice per metadata item (~250k slices for a 49k-token vocabulary), and each memmap slice runs
numpy's Python-level memmap hooks; on the plain view the same parse takes about a third of the time.

A parsed reader keeps the whole file mapped (and, for the arrays it parses, many small objects): once the weights are
loaded, `release_gguf_readers()` drops them and hands the freed heap back to the system.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pagedllm.model.heap import trim_heap

# An array of metadata with more items than this (a vocabulary's tokens, scores, types, merges) is skipped over
# rather than parsed: its field keeps its length (`len(field.data)`) but not its values, which neither the config
# nor the weights read (the tokenizer is converted by transformers, from the file).
LAZY_ARRAY_MIN_ITEMS = 4096
_STRING, _ARRAY = 8, 9  # GGUFValueType
_PATCH_LOCK = threading.Lock()
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"  # the fast paths read lengths as little-endian


@functools.cache
def reader_classes() -> tuple[type, type]:
    """(the reader open_gguf uses, one that parses every item as gguf does): gguf.GGUFReader over a plain ndarray
    view of the mapping. The first skips over large arrays (LAZY_ARRAY_MIN_ITEMS); the second parses them with
    a tight loop into the parts gguf's own parse gives (a view per string, a one-item view per number), for readers
    of every item, such as transformers' conversion of a GGUF tokenizer (`fast_full_reader`)."""
    import gguf
    import numpy as np

    class ViewReader(gguf.GGUFReader):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)  # same pages; the view keeps the mapping alive through .base
            super().__setattr__(name, value)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            if int(raw_type) == _ARRAY and self.byte_order == "I" and _LITTLE_ENDIAN_HOST:
                view = memoryview(self.data)
                item_type, count = struct.unpack_from("<IQ", view, orig_offs)
                if count > LAZY_ARRAY_MIN_ITEMS:
                    parsed = self._large_array(view, orig_offs, item_type, count)
                    if parsed is not None:
                        end, items, data = parsed
                        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64), *items]
                        types = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(item_type)]
                        return end - orig_offs, parts, data, types
            return super()._get_field_parts(orig_offs, raw_type)

        def _large_array(
            self, view: memoryview, offs: int, item_type: int, count: int
        ) -> tuple[int, list[Any], list[int]] | None:
            """Skipped: (its end, no parts, its item indices)."""
            end = _skip_items(view, offs + 12, item_type, count, self.gguf_scalar_to_np)
            return None if end is None else (end, [], list(range(count)))

    class FullReader(ViewReader):
        def _large_array(
            self, view: memoryview, offs: int, item_type: int, count: int
        ) -> tuple[int, list[Any], list[int]] | None:
            """Parsed: (its end, its items' parts, the index of each item's value among the field's parts)."""
            data, offs = self.data, offs + 12
            if item_type == _STRING:
                unpack = struct.Struct("<Q").unpack_from
                items: list[Any] = []
                for _ in range(count):
                    n = unpack(view, offs)[0]
                    items += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + n])
                    offs += 8 + n
                return offs, items, list(range(3, 2 + 2 * count + 1, 2))
            np_type = next((t for v, t in self.gguf_scalar_to_np.items() if int(v) == item_type), None)
            if np_type is None:
                return None
            values = data[offs : offs + count * np.dtype(np_type).itemsize].view(np_type)
            return offs + values.nbytes, [values[i : i + 1] for i in range(count)], list(range(2, 2 + count))

    return ViewReader, FullReader


@contextlib.contextmanager
def fast_full_reader() -> Iterator[None]:
    """Within it, gguf.GGUFReader is the full reader of `reader_classes` (the same fields and tensors, ~10x faster on
    a large vocabulary): for code that builds its own reader, such as transformers' GGUF tokenizer conversion. Another
    thread building a reader meanwhile gets the full reader too (the same fields and tensors)."""
    import gguf

    with _PATCH_LOCK:  # one thread at a time: each restores what it replaced
        original, full = gguf.GGUFReader, reader_classes()[1]
        gguf.GGUFReader = full
        try:
            yield
        finally:
            gguf.GGUFReader = original


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime: float, size: int) -> Any:
    return reader_classes()[0](path)


def _skip_items(view: memoryview, offs: int, item_type: int, count: int, scalars: dict[Any, Any]) -> int | None:
    """The offset past `count` items of `item_type` from `offs` (strings: their little-endian lengths walked); None
    for nested arrays, which the reader parses itself."""
    if item_type == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            offs += 8 + unpack(view, offs)[0]
        return offs
    for value_type, np_type in scalars.items():
        if int(value_type) == item_type:
            import numpy as np

            return offs + count * np.dtype(np_type).itemsize
    return None


def open_gguf(path: str) -> Any:
    """The (cached) gguf.GGUFReader of `path`; a changed file is parsed again."""
    st = os.stat(path)
    return _open(os.path.abspath(path), st.st_mtime, st.st_size)


def release_gguf_readers() -> None:
    """Drop every cached reader (a later `open_gguf` parses again) and return the freed memory to the system: the
    parse leaves hundreds of MB of small objects on the heap, which glibc keeps unless asked (malloc_trim)."""
    _open.cache_clear()
    gc.collect()
    trim_heap()
