"""One parsed GGUFReader per file per process: parsing the metadata of a GGUF file takes seconds (its token
list alone has tens of thousands of strings), and the config, the weights and the tokenizer all need it.

The reader parses over a plain ndarray view of the file's mapping rather than gguf's np.memmap: it slices the
mapping once or twice per metadata item (~250k slices for a 49k-token vocabulary), and each memmap slice runs
numpy's Python-level memmap hooks; on the plain view the same parse takes about a third of the time.

A parsed reader is large (~250 MB for a 152k-token vocabulary) and keeps the whole file mapped: once the weights are
loaded, `release_gguf_readers()` drops them and hands the freed heap back to the system.
"""

from __future__ import annotations

import functools
import gc
import os
from typing import Any

from pagedllm.model.heap import trim_heap


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime: float, size: int) -> Any:
    import gguf
    import numpy as np

    class _Reader(gguf.GGUFReader):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)  # same pages; the view keeps the mapping alive through .base
            super().__setattr__(name, value)

    return _Reader(path)


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
