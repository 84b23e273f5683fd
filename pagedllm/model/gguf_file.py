"""One parsed GGUFReader per file per process: parsing the metadata of a GGUF file takes seconds (its token
list alone has tens of thousands of strings), and the config, the weights and the tokenizer all need it."""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime: float, size: int):
    import gguf

    return gguf.GGUFReader(path)


def open_gguf(path: str):
    """The (cached) gguf.GGUFReader of `path`; a changed file is parsed again."""
    st = os.stat(path)
    return _open(os.path.abspath(path), st.st_mtime, st.st_size)
