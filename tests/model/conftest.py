"""The native CPU kernels for the kernel tests, one build per instruction set.

`isa_ops` runs a test once per ISA build (avx512, avx2, generic): on a CPU without that ISA the case is skipped and
says so; where the kernels are not built, the case fails if this machine has a C++ compiler (the install should have
built them: a missing build is a bug, not a reason to skip) and is skipped otherwise.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from pagedllm.model.kernels import ISAS, KernelsUnavailable, detect_isa, load_cpu_ops


def cpu_ops_for(isa: str) -> Any:
    """The native ops of `isa`, or a skip (CPU without it, or no compiler and so no build)."""
    try:
        best = detect_isa()
    except KernelsUnavailable as exc:
        if shutil.which("c++") is None:
            pytest.skip(f"no C++ compiler, so no native kernels: {exc}")
        raise
    if ISAS.index(isa) < ISAS.index(best):
        pytest.skip(f"this CPU has no {isa} (its best kernel build is {best})")
    return load_cpu_ops(isa)


@pytest.fixture(params=ISAS, scope="module")
def isa_ops(request: pytest.FixtureRequest) -> Any:
    return cpu_ops_for(request.param)
