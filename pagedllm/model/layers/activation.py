"""Gated activations over a merged gate|up projection: SiLU-and-multiply (Llama-family MLPs) and
GELU(tanh)-and-multiply (Gemma's `gelu_pytorch_tanh`), and GELU(tanh) alone (MLPs without a gate); each a native
kernel on the CPU where the layer has the ops (the fused decoder's arithmetic), else torch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self, ops: Any = None) -> None:
        super().__init__()
        self.ops = ops  # the native CPU ops, or None: plain torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        ops = self.ops
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            out = x.new_empty(x.shape[0], d)
            ops.silu_and_mul(out, x)
            return out
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up over [.., 2 I] = gate | up: transformers' gelu_pytorch_tanh MLP."""

    def __init__(self, ops: Any = None) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if self.ops is not None and x.dim() == 2 and x.is_contiguous():
            out = x.new_empty(x.shape[0], d)
            self.ops.gelu_tanh(out, x, True)
            return out
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


class GeluTanh(nn.Module):
    """gelu(x, approximate="tanh"): transformers' gelu_pytorch_tanh and gelu_new, for MLPs without a gate."""

    def __init__(self, ops: Any = None) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.is_contiguous():
            out = torch.empty_like(x)
            self.ops.gelu_tanh(out, x, False)
            return out
        return F.gelu(x, approximate="tanh")
