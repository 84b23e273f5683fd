"""Shared pytest fixtures. Keep this minimal: helpers live in tests/model_utils.py.

The native CPU decode kernel (the default attention backend here) is built once per machine and cached under
~/.cache/torch_extensions; the first engine of a fresh machine pays the ~30 s build.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per test session where `model_utils.make_tiny_model` writes (and reuses) tiny models."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session", autouse=True)
def _forget_the_sessions_weight_cache_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end, delete the weight cache files (model/weight_cache.py) of GGUF files this session wrote under its
    temporary folder: they are never hit again, and a few sessions' worth would fill a small disk."""
    yield
    from pagedllm.model import weight_cache

    base = str(tmp_path_factory.getbasetemp().resolve())
    for file in glob.glob(os.path.join(glob.escape(weight_cache.weights_dir()), "*.safetensors")):
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                source = json.loads(f.read(min(n, 1 << 20)).rstrip())["__metadata__"]["source"]
            if os.path.realpath(source).startswith(base + os.sep):
                os.unlink(file)
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            continue


@pytest.fixture(autouse=True)
def _seeded_torch(request: pytest.FixtureRequest) -> None:
    """Seed torch's generator from the test's id, so random inputs (and a tolerance they happen to graze) are the
    same on every run and every machine rather than a one-in-a-thousand failure on some CI run."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
