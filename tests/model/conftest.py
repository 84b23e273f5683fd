"""The native CPU kernels for the kernel tests, one build per instruction set.

`isa_ops` runs a test once per ISA build (avx512bf16, avx512, avx2, generic), and once more as "amx": the
avx512bf16 build with its bf16 panels of many rows on AMX tiles (the avx512bf16 case turns AMX off, so both paths
run where the CPU has AMX; elsewhere the amx case is skipped). On a CPU without an ISA its case is skipped and says
so; where the kernels are not built, the case fails if this machine has a C++ compiler (the install should have
built them: a missing build is a bug, not a reason to skip) and is skipped otherwise.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
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


@pytest.fixture(params=("amx", *ISAS), scope="module")
def isa_ops(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param != "amx":
        ops = cpu_ops_for(request.param)
        ops.bf16_amx(0)  # the AVX512-BF16 path (a no-op on the other builds)
        yield ops
        ops.bf16_amx(1)  # back to the default: on where the CPU has it
        return
    ops = cpu_ops_for("avx512bf16")
    if not ops.bf16_amx(1):
        pytest.skip("this CPU (or its OS) has no AMX tiles for bf16")
    yield ops
