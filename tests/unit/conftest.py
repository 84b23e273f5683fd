"""Fixtures of the unit tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(params=["torch", "native"])
def sampler_native(request: pytest.FixtureRequest) -> Any:
    """None (the sampler's torch path), then the native CPU ops (`sample_rows`, the path CPU rows take in the
    engine); that case is skipped where the kernels are not built."""
    if request.param == "torch":
        return None
    from pagedllm.model.kernels import load_cpu_ops

    try:
        return load_cpu_ops()
    except Exception as exc:
        pytest.skip(f"native CPU kernels unavailable: {exc}")


@pytest.fixture
def sampler_backend(request: pytest.FixtureRequest, sampler_native: Any) -> Any:
    """Sets the requesting module's NATIVE to `sampler_native` for the test (modules whose helpers build their
    samplers with it take it with `pytestmark = pytest.mark.usefixtures("sampler_backend")`)."""
    request.module.NATIVE = sampler_native
    yield
    request.module.NATIVE = None
