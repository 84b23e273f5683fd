"""RMSNorm, optionally fused with the residual add that precedes it (one pass instead of two); LayerNorm (with its
bias) for the models that use it (Starcoder2, StableLM, Phi), the same two forms.

With the native CPU ops (given when the layer is built, for float32 on the CPU) both forms are one C++ pass, and the
fused form works in place as vLLM's does: `x` becomes the normalised sum and `residual` the sum, so callers must own
both tensors (here they are always fresh layer outputs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32, ops: Any = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops  # the native CPU ops, or None: plain torch
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; the same arithmetic as below for float32 inputs.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        ops = self.ops
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                out = torch.empty_like(x)
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            if residual.is_contiguous():
                ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.Module):
    """Layer norm with a weight and a bias (HF's nn.LayerNorm parameters, replicated on every rank): with the native
    ops one C++ pass, the fused decoder's arithmetic; else torch's."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        dtype: torch.dtype = torch.float32,
        bias: bool = True,
        ops: Any = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops  # the native CPU ops, or None: plain torch
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), as RMSNorm's fused form (in
        place with the native ops)."""
        ops = self.ops
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            if residual is None:
                out = torch.empty_like(x)
                ops.layer_norm(out, x, self.weight, self.bias, self.eps)
                return out
            if residual.is_contiguous():
                ops.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
                return x, residual
        if residual is None:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        x = x + residual
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps), x


def make_norm(kind: str, hidden_size: int, eps: float, dtype: torch.dtype, ops: Any = None) -> RMSNorm | LayerNorm:
    """A norm of a layer description's kind (model/layers/description.py): "rms" (RMSNorm, on the native ops where
    given) or "layer" (LayerNorm with a bias)."""
    if kind == "rms":
        return RMSNorm(hidden_size, eps, dtype, ops)
    if kind == "layer":
        return LayerNorm(hidden_size, eps, dtype, ops=ops)
    raise ValueError(f"unknown norm kind {kind!r} (rms and layer are)")
