"""The decoder layer of every architecture's layer path, run as its LayerDescription (model/layers/description.py)
says: which norms sit where, parallel or sequential attention and MLP, the residual multiplier.

Contract. `DecoderLayer(desc, self_attn, mlp, norms)` holds the attention module (forward(h, plan: StepPlan) -> [T,
hidden]), the MLP (forward(h, rows: RowKinds) -> [T, hidden]) and the norms the description names, under those names
(the checkpoint's and the fused decoder's). Its forward carries the residual stream as a pair, as the fused decoder
does: `x` is the output the last layer has not yet added, `residual` the stream before it (None at the first layer,
where x is the embedding). The add of x joins the next norm in one pass (RMSNorm's and LayerNorm's `norm(x, residual)`),
and the model's final norm takes the last layer's pair. The sums are the fused decoder's, in its order: residual + (post
norm of the output, or the output times the multiplier).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.step_plan import StepPlan


class DecoderLayer(nn.Module):
    def __init__(
        self, desc: LayerDescription, self_attn: nn.Module, mlp: nn.Module, norms: dict[str, nn.Module]
    ) -> None:
        super().__init__()
        self.desc = desc
        self.self_attn = self_attn
        self.mlp = mlp
        named = [n for n in desc.norms if n is not None]
        if set(named) != set(norms):
            raise ValueError(f"decoder layer: the description names the norms {named}, got {sorted(norms)}")
        for name in named:
            self.add_module(name, norms[name])
        self._norms = tuple(None if n is None else norms[n] for n in desc.norms)

    def _add_norm(self, role: int, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of role `role` over residual + x, residual + x); at the first layer (residual None) x is the
        stream itself. Without a norm there, the input is the stream."""
        norm = self._norms[role]
        if residual is None:
            return (x if norm is None else norm(x)), x
        if norm is None:
            residual = residual + x
            return residual, residual
        return norm(x, residual)

    def _joining(self, role: int, y: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream: through its post norm (role 2 or 3), or times the
        residual multiplier."""
        norm = self._norms[role]
        if norm is not None:
            return norm(y)
        m = self.desc.residual_multiplier
        return y * m if m != 1.0 else y

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._add_norm(0, x, residual)
        a = self._joining(2, self.self_attn(h, plan))
        if self.desc.parallel:
            residual = residual + a  # the MLP reads the same h
        else:
            h, residual = self._add_norm(1, a, residual)
        return self._joining(3, self.mlp(h, plan.rows)), residual
