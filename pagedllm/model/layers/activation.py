"""SiLU-and-multiply: the gated activation of Llama-family MLPs, over a merged gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers.cpu_kernels import active_for


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        ops = active_for(x)
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            out = x.new_empty(x.shape[0], d)
            ops.silu_and_mul(out, x)
            return out
        return F.silu(x[..., :d]) * x[..., d:]
