"""A mixture-of-experts MLP: a router picks each token's top-k experts, each a gated MLP (SiLU, or gpt-oss's clamped
SwiGLU), and the token's output is the routing-weighted sum of its experts' outputs (Mixtral, Qwen3-MoE, OLMoE,
gpt-oss).

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
A GGUF expert's quantized tensor (QuantTensor) is kept as stored where the native ops run its type and this rank's
share of it is whole rows (gate, up) or whole blocks (down); when every expert's weights are so kept the layer runs
them quantized, else all are de-quantized.

With the native CPU ops the layer runs on the fused experts kernel (csrc/cpu/moe.cpp, `ops.moe_layer`): routing,
each expert once for all its rows, and the weighted sum in one call, the experts' weights quantized as stored, in
bf16 panels (`--dtype bfloat16`) or float32 panels; the torch loop (`forward`) is the reference and the path without
them. Every expert's gate, up and down must be loaded (settle_quant raises otherwise: the weights start uninitialised).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model import hugepages
from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.linear import ReplicatedLinear, RowKinds, panel_shape
from pagedllm.model.quant import QuantParts, QuantTensor, keeps

logger = logging.getLogger(__name__)

SCORINGS = ("softmax_topk", "topk_softmax")  # csrc/cpu/kernels.h PagedllmMoeScoring, in order
ACTS = ("silu", "swiglu_clamp")  # PagedllmMoeAct, in order


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of router logits [T, E]: softmax over all experts in float32,
    the k largest (descending), renormalised to sum 1 where asked; or ("topk_softmax", gpt-oss) the k largest
    logits and a softmax over them alone."""
    if scoring == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
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
        scoring: str = "softmax_topk",
        act: str = "silu",
        bias: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        """`scoring` (route), `act` ("silu", or gpt-oss's "swiglu_clamp" with `alpha` and `limit`) and `bias` (a
        router bias and the experts' biases, gpt-oss) as kernels.h's MoeExperts says."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (the experts), got {top_k}")
        if scoring not in SCORINGS or act not in ACTS:
            raise ValueError(f"MoE scoring must be one of {SCORINGS} and act one of {ACTS}, got {scoring!r}, {act!r}")
        self.tp = tp or TensorParallelGroup()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.scoring, self.act_kind, self.alpha, self.limit = scoring, act, float(alpha), float(limit)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shard = self.tp.shard(intermediate_size)  # this rank's rows of every expert's intermediate dimension
        local = self.shard.count
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias, dtype, ops)  # the router
        # Uninitialised (as the dense linears' weights): experts kept quantized never touch these pages, so a GGUF
        # model's float32 copies (24 GB for OLMoE-1B-7B) are never resident.
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        # gpt-oss's expert biases: gate|up [E, 2 I_local] (this rank's share), down [E, hidden] (rank 0 adds it: the
        # ranks' partial sums are all-reduced)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * local, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype), requires_grad=False)
            self.w13_bias.weight_loader = self._bias_loader
            self.w2_bias.weight_loader = self._bias_loader
        self.act = SiluAndMul(ops)  # the dense MLP's gate (native on the CPU)
        self.ops = ops
        # GGUF experts kept as stored, per expert, until pack_weights: W13 (gate rows, then up rows) and W2.
        self.quant13 = [QuantParts(2 * local, hidden_size) for _ in range(num_experts)]
        self.quant2 = [QuantParts(hidden_size, local) for _ in range(num_experts)]
        self.native: Any = None  # the kernels' MoeLayer, once packed
        self.quantized = False  # whether the experts run quantized as stored
        self.expert_nbytes = 0  # bytes of every expert's weights as the kernel holds them, once packed
        self.expert_arena: torch.Tensor | None = None  # the packed experts' memory (the kernel points into it)
        self.loaded: set[tuple[int, str]] = set()  # (expert, gate / up / down) loaded so far

    def weight_loader(
        self, param: nn.Parameter, tensor: torch.Tensor | QuantTensor, expert: int | None = None, part: str = ""
    ) -> None:
        """One checkpoint tensor into `param` (see the module docstring); this rank's rows of the intermediate
        dimension only."""
        first, count, inter = self.shard.first, self.shard.count, self.intermediate_size
        names = {"gate_proj": ["gate"], "up_proj": ["up"], "gate_up_proj": ["gate", "up"], "down_proj": ["down"]}
        for e in range(self.num_experts) if expert is None else [expert]:
            self.loaded.update((e, name) for name in names.get(part, []))
        if isinstance(tensor, QuantTensor) and expert is not None and self._keep_quant(param, tensor, expert, part):
            return
        if isinstance(tensor, QuantTensor):
            tensor = tensor.dequantize()
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

    def _bias_loader(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        """gate|up biases [E, 2I] (gate columns, then up) to this rank's columns; down biases [E, hidden] on rank 0
        (zero elsewhere)."""
        E, inter, first, count = self.num_experts, self.intermediate_size, self.shard.first, self.shard.count
        if param is self.w13_bias:
            if tuple(tensor.shape) != (E, 2 * inter):
                raise ValueError(f"gate_up bias of shape {tuple(tensor.shape)}, expected {(E, 2 * inter)}")
            for half in (0, 1):
                param.data[:, half * count : (half + 1) * count].copy_(
                    tensor[:, half * inter + first : half * inter + first + count]
                )
            return
        if tuple(tensor.shape) != (E, self.hidden_size):
            raise ValueError(f"down bias of shape {tuple(tensor.shape)}, expected {(E, self.hidden_size)}")
        param.data.copy_(tensor if self.tp.rank == 0 else torch.zeros_like(tensor))

    def _keep_quant(self, param: nn.Parameter, tensor: QuantTensor, expert: int, part: str) -> bool:
        """Keep one expert's GGUF tensor as stored (this rank's rows of gate/up, its block-aligned columns of
        down) where the native ops run it; False: the caller de-quantizes it."""
        first, count, inter, hidden = self.shard.first, self.shard.count, self.intermediate_size, self.hidden_size
        if not 0 <= expert < self.num_experts or tensor.is_half:
            return False
        if param is self.w13_weight and part in ("gate_proj", "up_proj") and tuple(tensor.shape) == (inter, hidden):
            if not keeps(self.ops, tensor, hidden):
                return False
            self.quant13[expert].add(0 if part == "gate_proj" else count, tensor.narrow(0, first, count))
            return True
        if param is self.w2_weight and part == "down_proj" and tuple(tensor.shape) == (hidden, inter):
            part_cols = tensor.narrow(1, first, count)
            if not isinstance(part_cols, QuantTensor) or not keeps(self.ops, part_cols, count):
                return False
            self.quant2[expert].add(0, part_cols)
            return True
        return False

    def settle_quant(self) -> None:
        """After loading: the experts run quantized only if every expert's W13 and W2 were kept as stored; else the
        kept ones are de-quantized into the float weights. A quantized router is de-quantized (it runs on float32
        panels)."""
        missing = [(e, n) for e in range(self.num_experts) for n in ("gate", "up", "down") if (e, n) not in self.loaded]
        if missing and self.loaded:  # (nothing loaded: a model built without weights, e.g. in a test)
            raise ValueError(
                f"the checkpoint lacks {len(missing)} expert projections, e.g. expert {missing[0][0]}'s "
                f"{missing[0][1]}_proj"
            )
        parts = self.quant13 + self.quant2
        if any(p.parts for p in parts) and not all(p.complete() for p in parts):
            logger.warning(
                "a MoE layer's experts cannot all stay quantized (this rank's share of a down projection is not whole "
                "blocks of its type, tensor parallel %d, or a type without a kernel): all %d experts de-quantized to "
                "float32, %.1f GB",
                self.tp.world_size,
                self.num_experts,
                (self.w13_weight.numel() + self.w2_weight.numel()) * 4 / 1e9,
            )
            for e in range(self.num_experts):
                self.quant13[e].dequantize_into(self.w13_weight.data[e])
                self.quant2[e].dequantize_into(self.w2_weight.data[e])
        if self.gate.quant is not None:
            self.gate.quant.dequantize_into(self.gate.weight.data)
            self.gate.quant = None

    def pack_weights(
        self, panels_out: torch.Tensor | None = None, quant_out: list[torch.Tensor] | None = None, bf16: bool = False
    ) -> bool:
        """Build the kernels' MoeLayer: the router's float32 panels, and the experts quantized as stored (each
        expert's bytes in one huge-page arena), else in bf16 panels (`bf16`) or float32 panels. Without native ops:
        nothing (the torch loop runs)."""
        ops = self.ops
        if ops is None or self.w13_weight.device.type != "cpu" or self.w13_weight.dtype != torch.float32:
            return False
        self.settle_quant()
        router = ops.pack_panels(self.gate.weight.detach().contiguous())
        router_bias = self.gate.bias.detach() if self.gate.bias is not None else None
        inter = self.shard.count
        kwargs: dict[str, Any] = {}
        if all(p.complete() for p in self.quant13 + self.quant2):
            shapes = [p.shapes() for p in self.quant13 + self.quant2]
            self.expert_arena, views = hugepages.arena([shape for expert in shapes for shape in expert], torch.uint8)
            built = []
            for p, expert in zip(self.quant13 + self.quant2, shapes, strict=True):
                built.append(p.build(ops, views[: len(expert)]))
                views = views[len(expert) :]
            kwargs.update(w13_quant=built[: self.num_experts], w2_quant=built[self.num_experts :])
            self.quantized = True
            self.expert_nbytes = sum(q.nbytes for q in built)
        else:
            pack = ops.bf16_pack_panels if bf16 else ops.pack_panels
            dtype = torch.bfloat16 if bf16 else torch.float32
            shape13 = panel_shape(self.w13_weight.data[0], ops, bf16)
            shape2 = panel_shape(self.w2_weight.data[0], ops, bf16)
            E = self.num_experts
            self.expert_arena, (w13, w2) = hugepages.arena([(E, *shape13), (E, *shape2)], dtype)
            for e in range(E):
                pack(self.w13_weight.data[e].contiguous(), w13[e])
                pack(self.w2_weight.data[e].contiguous(), w2[e])
            kwargs.update(w13_panels=w13, w2_panels=w2)
            self.expert_nbytes = sum(t.numel() * t.element_size() for t in (w13, w2))
        biases = {}
        if self.w13_bias is not None:
            biases = dict(b13=self.w13_bias.detach().contiguous(), b2=self.w2_bias.detach().contiguous())
        self.native = ops.moe_layer(
            router, router_bias, self.top_k, SCORINGS.index(self.scoring), self.renormalize,
            ACTS.index(self.act_kind), self.alpha, self.limit, self.hidden_size, inter, **kwargs, **biases,
        )  # fmt: skip
        empty = torch.empty(0, dtype=self.w13_weight.dtype)
        self.w13_weight.data, self.w2_weight.data = empty, empty.clone()
        return True

    def forward(self, x: torch.Tensor, rows: RowKinds | None = None) -> torch.Tensor:
        if self.native is not None:
            if rows is None and self.quantized:
                raise ValueError("quantized experts need the kinds of their input rows (RowKinds), none was given")
            state = False if rows is None else rows.state
            int8 = state if isinstance(state, bool) else rows.mask
            return self.tp.all_reduce(self.native(x.contiguous(), int8))
        weights, ids = route(self.gate(x, rows), self.top_k, self.renormalize, self.scoring)
        out = torch.zeros_like(x)
        hit = torch.bincount(ids.flatten(), minlength=self.num_experts)
        biased = self.w13_bias is not None
        for e in hit.nonzero().flatten().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            gu = F.linear(x[token], self.w13_weight[e], self.w13_bias[e] if biased else None)
            y = F.linear(self._activate(gu), self.w2_weight[e], self.w2_bias[e] if biased else None)
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return self.tp.all_reduce(out)

    def _activate(self, gu: torch.Tensor) -> torch.Tensor:
        if self.act_kind == "silu":
            return self.act(gu)
        gate, up = gu.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
