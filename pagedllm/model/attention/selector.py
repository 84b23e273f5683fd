"""Chooses the engine's attention backend once, from the config: `torch` or `cpu_native` ("auto": cpu_native where
it applies, the CPU in float32 with the native kernels built, else torch)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.attention.backends.base import AttentionBackend
from pagedllm.model.attention.backends.cpu_native import CpuNativeAttentionBackend
from pagedllm.model.attention.backends.torch_sdpa import TorchAttentionBackend

BACKENDS = ("torch", "cpu_native")


def native_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native CPU kernels can run a model on `device` in `dtype`."""
    return device.type == "cpu" and dtype == torch.float32


def select_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype, cpu_ops: Any
) -> AttentionBackend:
    """The backend for `requested` ("auto", "torch" or "cpu_native"); ValueError where cpu_native cannot run."""
    if requested == "torch" or (requested == "auto" and (cpu_ops is None or not native_applies(device, dtype))):
        return TorchAttentionBackend()
    if requested not in ("auto", "cpu_native"):
        raise ValueError(f"attention backend must be auto, {' or '.join(BACKENDS)}, got {requested!r}")
    if not native_applies(device, dtype):
        raise ValueError(f"attention backend 'cpu_native' needs the CPU and float32, got {device.type} and {dtype}")
    if cpu_ops is None:
        raise ValueError("attention backend 'cpu_native': the native CPU kernels are not available here (see the log)")
    return CpuNativeAttentionBackend(cpu_ops)
