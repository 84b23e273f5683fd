"""Starcoder2: LayerNorm (with bias) before attention and the MLP, biases on every linear, a GELU(tanh) MLP without
a gate (c_fc, c_proj), the sliding window of its config on every layer, a tied head; rotary over whole heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.layernorm_family import LayerNormModel, PlainMLP
from pagedllm.model.models.llama import LlamaForCausalLM


class Starcoder2Model(LayerNormModel):
    eps_name = "norm_epsilon"
    windows = True

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        self.o_bias = self.use_bias = bool(getattr(config, "use_bias", True))  # on q/k/v, o and the MLP alike
        super().__init__(config, dtype, self.use_bias, desc, kernels)

    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        return PlainMLP(config, dtype, kernels, desc, self.use_bias)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj")
        return LayerDescription(norm="layer", linears=linears, mlp="plain", act="gelu_tanh")

    # its q/k/v (and their biases) merge as Llama's; c_fc and c_proj load as they are
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
