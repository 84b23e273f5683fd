"""A hash of the native kernels' sources: setup.py compiles it into every build, and the loader compares it with the
sources beside the package, so that a build older than its sources (edited C++ without `make setup`) is noticed.

Importable on its own (setup.py loads this file by path, before pagedllm is installed): standard library only."""

from __future__ import annotations

import hashlib
import os

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")


def source_hash(source_dir: str = SOURCE_DIR) -> str | None:
    """sha256 (16 hex digits) over the names and bytes of the .cpp and .h files in source_dir, None if it has none."""
    try:
        names = sorted(n for n in os.listdir(source_dir) if n.endswith((".cpp", ".h")))
    except OSError:
        return None
    if not names:
        return None
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]
