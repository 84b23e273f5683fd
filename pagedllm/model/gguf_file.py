"""One parsed GGUFReader per file per process: parsing the metadata of a GGUF file takes seconds (its token
list alone has tens of thousands of strings), and the config, the weights and the tokenizer all need it.

The reader parses over a plain ndarray view of the file's mapping rather than gguf's np.memmap: it slices the
mapping once or twice per metadata item (~250k slices for a 49k-token vocabulary), and each memmap slice runs
numpy's Python-level memmap hooks; on the plain view the same parse takes about a third of the time.
"""

from __future__ import annotations

import functools
import os
from typing import Any


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
