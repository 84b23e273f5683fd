"""Shared pytest fixtures. Keep this minimal: helpers live in tests/model_utils.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per test session where `model_utils.make_tiny_model` writes (and reuses) tiny models."""
    return tmp_path_factory.mktemp("tiny_models")
