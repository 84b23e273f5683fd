"""Which kernels a model's layers run: the dispatch object the loader hands every layer when it is built.

Contract. `load_cpu_ops(isa)` opens the native CPU kernels built by the install (pagedllm/_C and
pagedllm/_cpu_<isa>, from pagedllm/csrc/cpu) for the best instruction set this CPU has ("auto") or the one named,
and returns its `CpuOps`, or raises `KernelsUnavailable` saying why (not built, a build older than its sources, a
CPU without that instruction set). `KernelDispatch(cpu, attention)` is what layers receive: the native ops where
they apply (None: plain torch) and the attention backend. Layers decide once, in their constructor, which kernel
they call; nothing is switched afterwards and nothing here is global.

Where a new kernel goes: its C++ in pagedllm/csrc/cpu/<family>.cpp, an entry in the ops table (kernels.h, ops.cpp),
a checked method on CpuOps (bindings.cpp), and the layer that uses it picks it from `dispatch.cpu` when built.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.csrc.source_hash import source_hash
from pagedllm.distributed.parallel_state import TensorParallelGroup

if TYPE_CHECKING:
    from pagedllm.model.attention.backends.base import AttentionBackend

ISAS = ("avx512bf16", "avx512", "avx2", "generic")  # best first
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class KernelsUnavailable(RuntimeError):
    """The native CPU kernels cannot be used here; the message says why."""


def _library(isa: str) -> str | None:
    paths = sorted(glob.glob(os.path.join(_PACKAGE_DIR, f"_cpu_{isa}.*so")))
    return paths[0] if paths else None


def _bindings() -> Any:
    try:
        import pagedllm._C as _C
    except ImportError as exc:
        raise KernelsUnavailable(
            f"the native CPU kernels are not built ({exc}); build them with `make setup` or `pip install -e .`"
        ) from None
    return _C


def detect_isa() -> str:
    """The best kernel instruction set this CPU runs: avx512bf16 (with VNNI), avx512, avx2 or generic."""
    return _bindings().detect_isa()


def available_isas() -> list[str]:
    """The kernel builds present that this CPU can run, best first ([] when the kernels are not built)."""
    try:
        best = ISAS.index(detect_isa())
    except KernelsUnavailable:
        return []
    return [isa for isa in ISAS[best:] if _library(isa) is not None]


def load_cpu_ops(isa: str = "auto") -> Any:
    """The native CPU kernels of `isa` ("auto": the best this CPU has) as a `pagedllm._C.CpuOps`."""
    if isa not in ("auto", *ISAS):
        raise ValueError(f"unknown kernel instruction set {isa!r}; choose auto, {', '.join(ISAS)}")
    C = _bindings()
    if isa == "auto":
        isa = C.detect_isa()
    path = _library(isa)
    if path is None:
        raise KernelsUnavailable(f"no {isa} build of the native CPU kernels in {_PACKAGE_DIR}; run `make setup`")
    try:
        ops = C.CpuOps(path)
    except RuntimeError as exc:
        raise KernelsUnavailable(str(exc)) from None
    current = source_hash()
    if current is not None and ops.source_hash != current:
        raise KernelsUnavailable(
            f"the native CPU kernels were built from other sources (build {ops.source_hash}, sources {current}): "
            "rebuild them with `make setup` or `pip install -e .`"
        )
    return ops


@dataclass(frozen=True)
class KernelDispatch:
    """What the layers of one model run: `cpu` the native CPU ops (None: plain torch; they apply to float32 CPU
    tensors only, so the loader gives them only to such a model), `attention` the attention backend, and `tp` the
    tensor-parallel group the layers shard themselves over (one rank by default). `bf16_weights`: the linear layers
    and the LM head keep their weights in bf16 panels and the embedding table in bf16 (`--dtype bfloat16` on the
    native ops; the model itself is built in float32)."""

    attention: AttentionBackend
    cpu: Any = None
    tp: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    bf16_weights: bool = False

    def cpu_for(self, dtype: torch.dtype) -> Any:
        """The native ops for a layer whose tensors are `dtype`, or None."""
        return self.cpu if dtype == torch.float32 else None


def torch_dispatch() -> KernelDispatch:
    """Plain torch everywhere (the reference path, any device)."""
    from pagedllm.model.attention.backends.torch_sdpa import TorchAttentionBackend

    return KernelDispatch(attention=TorchAttentionBackend())
