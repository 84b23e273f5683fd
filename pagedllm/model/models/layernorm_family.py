"""What Starcoder2, StableLM and Phi (Phi-2) share beside the Llama layers: LayerNorm with a bias instead of RMSNorm
(their descriptions say norm "layer"), an eps under their config's own name, rotary embedding over the first
`partial_rotary_factor` of each head, and (Starcoder2, Phi) an MLP without a gate. Each architecture's own file
composes these and describes its layers (plain or gated MLP, parallel or not), which the layer path and the fused
decoder run."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.activation import GeluTanh
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.linear import ColumnParallelLinear, RowKinds, RowParallelLinear
from pagedllm.model.models.llama import LlamaAttention, LlamaModel, layer_window


class LayerNormModel(LlamaModel):
    """A stack of LayerNorm layers: the eps under `eps_name`, q/k/v biases where `bias` says, the output projection's
    bias where `o_bias` says (None: the config's attention_bias); partial rotary as every stack reads it
    (LlamaModel.rotary_dim)."""

    eps_name = "layer_norm_eps"
    o_bias: bool | None = None
    windows = False  # the config's sliding window applies (Starcoder2's); StableLM and Phi have none in HF

    def norm_eps(self, config: Any) -> float:
        return float(getattr(config, self.eps_name))

    def build_attention(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        window = layer_window(config, index) if self.windows else None
        return LlamaAttention(config, dtype, bias, None, kernels, window, self.o_bias, self.rotary_dim(config))


class PlainMLP(nn.Module):
    """up (with bias) -> GELU(tanh) -> down (with bias), under the checkpoint's names for the two (the description's
    linear paths)."""

    def __init__(
        self, config: Any, dtype: torch.dtype, kernels: KernelDispatch, desc: LayerDescription, bias: bool = True
    ) -> None:
        super().__init__()
        names = plain_mlp_names(desc)
        if (desc.mlp, desc.act) != ("plain", "gelu_tanh"):
            raise ValueError(f"PlainMLP is a plain GELU(tanh) MLP; the description says {desc.mlp!r}, {desc.act!r}")
        act = getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh"):
            raise ValueError(f"MLP activation {act!r} is not supported (gelu_pytorch_tanh and gelu_new are)")
        ops, tp = kernels.cpu_for(dtype), kernels.tp
        self.names = names
        up = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias, dtype, ops, tp)
        down = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, dtype, ops, tp)
        self.add_module(names[0], up)
        self.add_module(names[1], down)
        self.act = GeluTanh(ops)

    def forward(self, x: torch.Tensor, rows: RowKinds) -> torch.Tensor:
        up, down = (getattr(self, n) for n in self.names)
        return down(self.act(up(x, rows)), rows)


def plain_mlp_names(desc: LayerDescription) -> tuple[str, str]:
    """The up and down projections' names in the MLP module, from the description's linear paths ("mlp.c_fc")."""
    return desc.linears[2].split(".")[-1], desc.linears[3].split(".")[-1]
