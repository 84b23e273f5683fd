"""Tensor-parallel-ready linear layers.

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies in the slice this
rank owns of a full checkpoint tensor: column-parallel layers split the output dimension, row-parallel
layers the input dimension (and all-reduce their partial sums). Merged layers (gate+up, q+k+v) hold several
checkpoint tensors in one matmul, which on a CPU saves a kernel launch and a pass over the activations. Each layer
is built with the worker's `TensorParallelGroup` (distributed/parallel_state.py; by default one rank): rows split as
evenly as they go (`even_shard`), attention heads by `attention_shard` (KV heads replicated when fewer than ranks).

GGUF weights run as stored (`ops.quant_linear`). How precisely depends on the row, which the model runner says in the
step plan's `RowKinds` (model/step_plan.py), passed to every linear: a generated token's row (a decode token, a draft,
or an output token recomputed after preemption) is quantized to int8 in blocks of 32 and multiplied in int8, as
llama.cpp does, at any batch size where the kernels keep the weight in their packed layout; a prompt token's row runs on
de-quantized bf16 or float32 panels (more than a few rows at once; on weights the kernels have not packed, the number of
rows decides), whose inputs keep 8 significant bits or more, not 8 bits of each block's largest value
(PAGEDLLM_PROMPT_INT8=1: int8 for every row, faster without AMX tiles). Each row's kind depends only on its own
position, so a request's output does not depend on what else shares its steps.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import Shard, TensorParallelGroup, attention_shard
from pagedllm.model import hugepages
from pagedllm.model.quant import QuantParts, QuantTensor, keeps

logger = logging.getLogger(__name__)

# Below this many rows, a CPU matmul is faster as a batch of per-thread slices of the weight (one bmm): MKL's own
# threading of skinny GEMMs leaves most of the memory bandwidth unused on the CPUs we measure on (bench/RESULTS.md).
# Used when oneDNN is missing.
SPLIT_GEMM_MAX_ROWS = 64
# Up to this many rows, the native ops (when the layer has them) run the product on the weight's panels: they stream
# the weight once for all rows, where oneDNN's GEMM reads it well below the memory bandwidth for few rows on two
# cores; from ~24 rows the two are level, both bound by compute (bench/RESULTS.md). Decode steps of up to a dozen or
# so requests are the case this serves.
PANEL_MAX_ROWS = 16


class RowKinds:
    """Which rows of a step's linear inputs are generated tokens (a decode token, a draft, an output token recomputed
    after preemption), whose inputs a quantized weight takes as int8: all rows (`RowKinds(True)`), none
    (`RowKinds(False)`: prompt tokens), or a bool mask over the rows. The step's StepPlan carries one for the model's
    forward (every linear reads it), and the rows it samples carry theirs to the head."""

    __slots__ = ("mask", "state")

    def __init__(self, rows: bool | torch.Tensor) -> None:
        self.mask = None if isinstance(rows, bool) else rows
        self.state: bool | tuple[int, torch.Tensor, torch.Tensor]
        if isinstance(rows, bool):
            self.state = rows
        elif bool(rows.all()) or not bool(rows.any()):
            self.state = bool(rows.all()) if rows.numel() else False
        else:
            self.state = (rows.numel(), rows.nonzero().flatten(), (~rows).nonzero().flatten())

    def select(self, index: torch.Tensor | None) -> RowKinds:
        """The kinds of rows `index` (None: all of them) of these rows."""
        if index is None or self.mask is None:
            return self
        return RowKinds(self.mask[index])

    def split(self, size: int) -> list[RowKinds]:
        """The kinds of consecutive chunks of `size` rows (as torch.split splits the rows)."""
        if self.mask is None:
            raise ValueError("RowKinds.split needs a mask (all or none: use the kinds as they are)")
        return [RowKinds(m) for m in self.mask.split(size)]

    def __repr__(self) -> str:
        state = self.state if isinstance(self.state, bool) else f"{self.state[1].numel()} of {self.state[0]}"
        return f"RowKinds({state})"


PROMPT_ROWS = RowKinds(False)  # no row takes int8 inputs
GENERATED_ROWS = RowKinds(True)  # every row does


def _quant_linear(
    ops: Any, x: torch.Tensor, qweight: Any, bias: torch.Tensor | None, rows: RowKinds | None
) -> torch.Tensor:
    """x [M, in] on a QuantMatrix, each row as `rows` marks it."""
    if rows is None:
        raise ValueError(
            "a quantized weight needs the kinds of its input rows (RowKinds: the step plan's `rows`), none was given"
        )
    state = rows.state
    if isinstance(state, bool):
        return ops.quant_linear(x, qweight, bias, state)
    n, int8_rows, other_rows = state
    if x.shape[0] != n:
        raise ValueError(f"the row kinds mark {n} rows, the linear got {x.shape[0]}")
    y = x.new_empty(n, qweight.out_features)
    y.index_copy_(0, int8_rows, ops.quant_linear(x.index_select(0, int8_rows), qweight, bias, True))
    y.index_copy_(0, other_rows, ops.quant_linear(x.index_select(0, other_rows), qweight, bias, False))
    return y


class Panels(NamedTuple):
    """A weight [out_features, I] laid out for the native few-row kernel: [ceil(O / w), I, w] (csrc/cpu/linear.cpp)."""

    data: torch.Tensor
    out_features: int


class Bf16Panels(NamedTuple):
    """A weight [out_features, I] rounded to bfloat16 in the native ops' pair panels, [ceil(O / w), ceil(I / 2), w,
    2] (csrc/cpu/bf16.cpp): `--dtype bfloat16` on the CPU."""

    data: torch.Tensor
    out_features: int


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-prepacked copy of a float32 CPU weight, or None where that path does not exist (on the CPUs we
    measure on, oneDNN's prepacked GEMM is well ahead of MKL's sgemm: bench/RESULTS.md)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError:
        return None


def panel_shape(weight: torch.Tensor, ops: Any, bf16: bool = False) -> tuple[int, ...] | None:
    """The shape of a weight's panels for the native ops, [ceil(O / w), I, w] (with `bf16`: its bf16 pair panels'),
    or None where they do not apply (no ops, or not a non-empty float32 CPU matrix)."""
    if ops is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if not weight.numel():
        return None
    if bf16:
        return tuple(ops.bf16_panel_shape(weight.shape[0], weight.shape[1]))
    width = ops.panel_width()
    return -(-weight.shape[0] // width), weight.shape[1], width


def pack_bf16_panels(weight: torch.Tensor, ops: Any, out: torch.Tensor | None = None) -> Bf16Panels | None:
    """The native ops' bf16 pair panels of a float32 CPU weight (into `out` when given), or None where they do not
    apply."""
    if panel_shape(weight, ops, bf16=True) is None:
        return None
    return Bf16Panels(ops.bf16_pack_panels(weight.detach().contiguous(), out), weight.shape[0])


def pack_panels(weight: torch.Tensor, ops: Any, out: torch.Tensor | None = None) -> Panels | None:
    """The native ops' panel layout of a float32 CPU weight, written into `out` when given (a contiguous tensor of
    `panel_shape`'s shape), or None where they do not apply."""
    if panel_shape(weight, ops) is None:
        return None
    return Panels(ops.pack_panels(weight.detach().contiguous(), out), weight.shape[0])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    panels: Panels | None = None,
    ops: Any = None,
    qweight: Any = None,
    bf16_panels: Bf16Panels | None = None,
    rows: RowKinds | None = None,
) -> torch.Tensor:
    """y = x W^T + b for x [M, in], weight [out, in], through the fastest path this device has: the quantized weight as
    stored (`qweight`, a QuantMatrix of `ops`; `rows` says which rows take int8 inputs), its bf16 panels (`--dtype
    bfloat16`), the native panels (with `ops`) for a few rows, oneDNN's packed copy, or torch. `weight` may be empty
    when `qweight`, `bf16_panels`, or `packed` and `panels`, cover it."""
    if qweight is not None:
        y = _quant_linear(ops, x.reshape(-1, x.shape[-1]).contiguous(), qweight, bias, rows)
        return y.view(*x.shape[:-1], -1)
    if bf16_panels is not None:
        y = ops.bf16_panel_linear(
            x.reshape(-1, x.shape[-1]).contiguous(), bf16_panels.data, bias, bf16_panels.out_features
        )
        return y.view(*x.shape[:-1], -1)
    if panels is not None and ops is not None and x.dim() == 2 and x.shape[0] <= PANEL_MAX_ROWS:
        return ops.panel_linear(x.contiguous(), panels.data, bias, panels.out_features)
    if packed is not None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    parts = torch.get_num_threads()
    out_features, in_features = weight.shape
    if (
        x.device.type != "cpu"
        or parts < 2
        or x.dim() != 2
        or x.shape[0] > SPLIT_GEMM_MAX_ROWS
        or out_features % parts
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    m = x.shape[0]
    w = weight.view(parts, out_features // parts, in_features).transpose(1, 2)
    y = torch.bmm(x.unsqueeze(0).expand(parts, m, in_features), w).transpose(0, 1).reshape(m, out_features)
    return y + bias if bias is not None else y


def prepare_for_inference(model: nn.Module, bf16: bool = False) -> int:
    """Prepack the weights of every layer that supports it (call after loading); returns how many. Layers built with
    the native CPU ops also get their weights' panels, packed straight into one huge-page arena laid out in the order
    a forward pass reads them (see hugepages.py); the plain weight is then dropped where oneDNN's copy and the panels
    cover every batch size. With `bf16` (`--dtype bfloat16` on the native ops) the panels are bf16 pair panels that
    serve every batch size, and the embedding table is kept in bf16: one bf16 copy of each weight. Quantized
    weights are copied from the file into a second such arena, in the same order, and run as stored."""
    modules = [module for module in model.modules() if getattr(module, "pack_weights", None) is not None]
    for module in modules:
        settle = getattr(module, "settle_quant", None)
        if settle is not None:
            settle()
    arena = panel_arena(modules, bf16)
    quant = quant_arena(modules)
    count = 0
    for module in modules:
        if module.pack_weights(arena.get(module), quant.get(module), bf16):
            count += 1
    return count


def quant_arena(modules: list[nn.Module]) -> dict[nn.Module, list[torch.Tensor]]:
    """Where each of these modules' quantized segments go: views of one huge-page byte arena, back to back."""
    shapes: dict[nn.Module, list[tuple[int, int]]] = {}
    for module in modules:
        parts = getattr(module, "quant", None)
        if isinstance(parts, QuantParts):
            shapes[module] = parts.shapes()
    if not shapes:
        return {}
    _, views = hugepages.arena([shape for module_shapes in shapes.values() for shape in module_shapes], torch.uint8)
    out: dict[nn.Module, list[torch.Tensor]] = {}
    for module, module_shapes in shapes.items():
        out[module], views = views[: len(module_shapes)], views[len(module_shapes) :]
    return out


def panel_arena(modules: list[nn.Module], bf16: bool = False) -> dict[nn.Module, torch.Tensor]:
    """Where each of these modules' panels go (the modules whose `panel_shape(bf16)` is not None): views of one
    huge-page arena (float32, or bfloat16 with `bf16`), back to back, the linear layers' in the order given (a forward
    pass's, for model.modules()), then the others' (the LM head's, read last). Packing into them directly spares a
    second copy of every weight."""
    shapes: dict[nn.Module, tuple[int, ...]] = {}
    for module in modules:
        shape_of = getattr(module, "panel_shape", None)
        shape = shape_of(bf16) if shape_of is not None else None
        if shape is not None:
            shapes[module] = shape
    order = [m for m in shapes if isinstance(m, LinearBase)] + [m for m in shapes if not isinstance(m, LinearBase)]
    if not order:
        return {}
    _, views = hugepages.arena([shapes[m] for m in order], torch.bfloat16 if bf16 else torch.float32)
    return dict(zip(order, views, strict=True))


@functools.cache
def _warn_split(type_name: str, width: int, ranks: int) -> None:
    """Once per (type, width): a row-parallel split that cuts the type's blocks de-quantizes this rank's slice."""
    logger.warning(
        "tensor parallel %d splits %s weights into slices %d wide, not whole blocks of the type: those slices are "
        "de-quantized to float32 on each rank",
        ranks,
        type_name,
        width,
    )


def _set_loader(param: nn.Parameter, loader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor) -> None:
    """Copy a whole tensor (replicated parameters); a quantized one is de-quantized."""
    if isinstance(loaded_weight, QuantTensor):
        loaded_weight = loaded_weight.dequantize()
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops  # the native CPU ops (few-row products on panels), or None
        self.tp = tp or TensorParallelGroup()
        self.input_size = input_size  # this rank's
        self.output_size = output_size  # this rank's
        self.tp_rank = self.tp.rank
        self.tp_size = self.tp.world_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.panels: Panels | None = None
        self.bf16_panels: Bf16Panels | None = None
        self.quant: QuantParts | None = None  # quantized rows as loaded, until pack_weights
        self.qweight: Any = None  # the native QuantMatrix the layer runs on, once packed
        self.half_source = False  # loaded from float16/bfloat16 GGUF tensors: kept in bf16 panels, not float32
        self.lora: Any = None  # LoRA adapters' slots (lora/layers.py LoRASlots) with --enable-lora

    def put_rows(self, param: nn.Parameter, first_row: int, tensor: torch.Tensor | QuantTensor) -> None:
        """Load `tensor` into rows [first_row, ...) of `param`: a quantized weight the native ops run is kept as
        stored, anything else (de-quantized if need be) copied."""
        if isinstance(tensor, QuantTensor):
            if param is self.weight and keeps(self.ops, tensor, self.input_size):
                if self.quant is None:
                    self.quant = QuantParts(self.output_size, self.input_size)
                self.quant.add(first_row, tensor)
                return
            if param is self.weight and tensor.is_half and self.ops is not None:
                self.half_source = True  # float32 until packed, then bf16 panels (pack_weights)
            tensor = tensor.dequantize()
        param.data.narrow(0, first_row, tensor.shape[0]).copy_(tensor)

    def settle_quant(self) -> None:
        """After loading: a weight only partly quantized (some of its checkpoint tensors float16 or bfloat16, or
        split off block boundaries) is de-quantized whole, and then runs on bf16 panels."""
        if self.quant is not None and not self.quant.complete():
            self.quant.dequantize_into(self.weight.data)
            self.quant = None
            self.half_source = self.ops is not None

    def panel_shape(self, bf16: bool = False) -> tuple[int, ...] | None:
        if self.quant is not None or self.qweight is not None or (self.half_source and not bf16):
            return None  # no float32 panels: quantized, or bf16 panels of its own (pack_weights)
        return panel_shape(self.weight, self.ops, bf16)

    def pack_weights(
        self, panels_out: torch.Tensor | None = None, quant_out: list[torch.Tensor] | None = None, bf16: bool = False
    ) -> bool:
        """Build the quantized weight (into `quant_out` when given: tensors of `quant.shapes()`), else with `bf16`
        the bf16 panels, else oneDNN's copy and the panels (into `panels_out` when given: a tensor of
        `panel_shape(bf16)`)."""
        self.settle_quant()
        if self.quant is not None:
            self.qweight = self.quant.build(self.ops, quant_out)
            self.qweight_bytes = self.quant.packed  # what the matrix points into (quant.py)
            self.quant = None
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
            return True
        if bf16 or self.half_source:
            self.bf16_panels = pack_bf16_panels(self.weight, self.ops, panels_out if bf16 else None)
            if self.bf16_panels is not None:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
                return True
        self.packed_weight = pack_weight(self.weight)
        self.panels = pack_panels(self.weight, self.ops, panels_out)
        if self.packed_weight is None:
            return self.panels is not None
        # oneDNN's copy serves every batch size (the panels the few-row ones): the plain weight is not read again.
        if self.ops is None or self.panels is not None:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return True

    def forward(self, x: torch.Tensor, rows: RowKinds | None = None) -> torch.Tensor:
        """x W^T + b; `rows`: the kinds of x's rows (model/layers/linear.py RowKinds), which a quantized weight
        needs."""
        y = linear(
            x, self.weight, self.bias, self.packed_weight, self.panels, self.ops, self.qweight, self.bf16_panels, rows
        )
        return y if self.lora is None else self.lora.apply(x, y)

    def forward_gelu(self, x: torch.Tensor, rows: RowKinds | None = None, approximate: str = "none") -> torch.Tensor:
        """gelu(x W^T + b) (`approximate`: "none", the erf form, or "tanh"): on oneDNN's packed weight the GELU runs in
        the GEMM's epilogue (the same values as torch's, without a second pass over the output); else after it."""
        packed = self.packed_weight
        few = self.panels is not None and self.ops is not None and x.shape[0] <= PANEL_MAX_ROWS
        adapted = self.lora is not None and self.lora.mapping.slots
        if (
            packed is not None
            and x.dim() == 2
            and self.qweight is None
            and self.bf16_panels is None
            and not few
            and not adapted
        ):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, self.bias, "gelu", [], approximate)
        return F.gelu(self(x, rows), approximate=approximate)


class ReplicatedLinear(LinearBase):
    """The full matrix on every rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32, ops: Any = None
    ) -> None:
        super().__init__(input_size, output_size, bias, dtype, ops)
        _set_loader(self.weight, self.weight_loader)
        if self.bias is not None:
            _set_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor) -> None:
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise ValueError(
                f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}"
            )
        self.put_rows(param, 0, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by columns (the output dimension); each rank keeps its slice of Y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup()
        super().__init__(input_size, self._local_output_size(output_size, tp), bias, dtype, ops, tp)
        _set_loader(self.weight, self.weight_loader)
        if self.bias is not None:
            _set_loader(self.bias, self.weight_loader)

    def _local_output_size(self, output_size: int, tp: TensorParallelGroup) -> int:
        return tp.shard(output_size).count

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor) -> None:
        shard = self.tp.shard(loaded_weight.shape[0])
        self.put_rows(param, 0, loaded_weight.narrow(0, shard.first, shard.count))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked along the output (e.g. gate_proj and up_proj), each split alike."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, dtype, ops, tp)

    def _local_output_size(self, output_size: int, tp: TensorParallelGroup) -> int:
        return sum(tp.shard(size).count for size in self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor, shard_id: int = 0) -> None:
        offset = sum(self.tp.shard(size).count for size in self.output_sizes[:shard_id])
        part = self.tp.shard(self.output_sizes[shard_id])
        self.put_rows(param, offset, loaded_weight.narrow(0, part.first, part.count))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matrix; heads split across ranks by `attention_shard` (KV heads replicated
    when there are fewer of them than ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup()
        self.head_dim = head_dim
        self.heads = attention_shard(num_heads, num_kv_heads, tp.world_size, tp.rank)
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, dtype, ops, tp)

    def _local_output_size(self, output_size: int, tp: TensorParallelGroup) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor, shard_id: str = "q"
    ) -> None:
        d, h = self.head_dim, self.heads
        q_size, kv_size = h.num_heads * d, h.num_kv_heads * d
        if shard_id == "q":
            offset, size, first = 0, q_size, h.first_head * d
        elif shard_id == "k":
            offset, size, first = q_size, kv_size, h.first_kv_head * d
        elif shard_id == "v":
            offset, size, first = q_size + kv_size, kv_size, h.first_kv_head * d
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        self.put_rows(param, offset, loaded_weight.narrow(0, first, size))


class RowParallelLinear(LinearBase):
    """Y = X A with A split by rows (the input dimension); partial sums are all-reduced. `input_shard` gives this
    rank's input rows where they follow another split (the attention heads'), else they split evenly."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
        input_shard: Shard | None = None,
    ) -> None:
        tp = tp or TensorParallelGroup()
        self.input_shard = input_shard or tp.shard(input_size)
        super().__init__(self.input_shard.count, output_size, bias, dtype, ops, tp)
        _set_loader(self.weight, self.weight_loader)
        if self.bias is not None:
            _set_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor) -> None:
        # A quantized weight stays so when this rank's columns are whole blocks (else the slice is de-quantized).
        part = loaded_weight.narrow(1, self.input_shard.first, self.input_shard.count)
        if isinstance(loaded_weight, QuantTensor) and not isinstance(part, QuantTensor):
            _warn_split(loaded_weight.dtype, self.input_shard.count, self.tp_size)
        self.put_rows(param, 0, part)

    def forward(self, x: torch.Tensor, rows: RowKinds | None = None) -> torch.Tensor:
        # The bias is added once, after the reduction, not once per rank; alone (one rank, no adapters) the kernel
        # adds it as it stores the sums, as the column-parallel layers do, instead of another pass over y.
        w, bias = self.weight, self.bias
        fused = bias is not None and self.tp_size == 1 and self.lora is None
        b = bias if fused else None
        y = linear(x, w, b, self.packed_weight, self.panels, self.ops, self.qweight, self.bf16_panels, rows)
        if self.lora is not None:  # this rank's part of the adapters' products, summed by the all-reduce
            y = self.lora.apply(x, y)
        y = self.tp.all_reduce(y)
        return y + bias if bias is not None and not fused else y
