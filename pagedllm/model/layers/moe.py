"""A mixture-of-experts MLP: a router picks each token's top-k experts, each a SiLU-gated MLP, and the token's
output is the routing-weighted sum of its experts' outputs (Mixtral, Qwen3-MoE, OLMoE).

Contract. `MoEMLP(hidden, inter, num_experts, top_k, renormalize, dtype, ops, tp)` holds the router [E, hidden] (`gate`,
a replicated linear) and every expert's weights stacked: `w13_weight` [E, 2 I_local, hidden] (gate rows, then up rows)
and `w2_weight` [E, hidden, I_local], where each rank keeps its share of every expert's intermediate dimension (the
dense MLP's split) and the partial sums are all-reduced once per layer. forward(x [T, hidden], rows) -> [T, hidden].

Routing as transformers computes it in eval (docs/moe-notes.md): softmax of the router logits over all experts in
float32, the top k, divided by their sum where `renormalize` (Mixtral always; Qwen3-MoE and OLMoE by
`norm_topk_prob`). Each expert runs once for all the step's rows routed to it, and its weighted output is added to
those rows in ascending expert order, as transformers' eager experts loop adds them.

Checkpoint tensors reach the stacked weights through `weight_loader(param, tensor, expert, part)`: one expert's
`gate_proj`, `up_proj` or `down_proj` [I, hidden] / [hidden, I] (`expert` its index), or all experts at once as
transformers 5 holds them in memory (`gate_up_proj` [E, 2I, hidden], `down_proj` [E, hidden, I]; `expert` None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.linear import ReplicatedLinear, RowKinds
from pagedllm.model.quant import QuantTensor


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of router logits [T, E]: softmax over all experts in float32,
    the k largest (descending), renormalised to sum 1 where asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (the experts), got {top_k}")
        self.tp = tp or TensorParallelGroup()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shard = self.tp.shard(intermediate_size)  # this rank's rows of every expert's intermediate dimension
        local = self.shard.count
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype, ops)  # the router
        self.w13_weight = nn.Parameter(
            torch.zeros(num_experts, 2 * local, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.zeros(num_experts, hidden_size, local, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        self.act = SiluAndMul(ops)  # the dense MLP's gate (native on the CPU)

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor | QuantTensor, expert: int | None = None, part: str = ""
    ) -> None:
        """One checkpoint tensor into `param` (see the module docstring); this rank's rows of the intermediate
        dimension only."""
        if isinstance(tensor, QuantTensor):
            tensor = tensor.dequantize()
        first, count, inter = self.shard.first, self.shard.count, self.intermediate_size
        experts = range(self.num_experts) if expert is None else [expert]
        if expert is not None:
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert} of a layer with {self.num_experts} experts")
            tensor = tensor.unsqueeze(0)
        if param is self.w13_weight:
            halves = {"gate_proj": [0], "up_proj": [1], "gate_up_proj": [0, 1]}[part]
            want = (len(experts), inter * len(halves), self.hidden_size)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{part} of experts {experts[0]}..: shape {tuple(tensor.shape)}, expected {want}")
            for j, half in enumerate(halves):
                src = tensor[:, j * inter + first : j * inter + first + count]
                param.data[experts[0] : experts[-1] + 1, half * count : (half + 1) * count].copy_(src)
        else:
            want = (len(experts), self.hidden_size, inter)
            if part != "down_proj" or tuple(tensor.shape) != want:
                raise ValueError(f"{part} of experts {experts[0]}..: shape {tuple(tensor.shape)}, expected {want}")
            param.data[experts[0] : experts[-1] + 1].copy_(tensor[:, :, first : first + count])

    def forward(self, x: torch.Tensor, rows: RowKinds | None = None) -> torch.Tensor:
        weights, ids = route(self.gate(x, rows), self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        hit = torch.bincount(ids.flatten(), minlength=self.num_experts)
        for e in hit.nonzero().flatten().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            gu = F.linear(x[token], self.w13_weight[e])
            y = F.linear(self.act(gu), self.w2_weight[e])
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return self.tp.all_reduce(out)
