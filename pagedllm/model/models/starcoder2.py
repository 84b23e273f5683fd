"""Starcoder2: LayerNorm (with bias) before attention and the MLP, biases on every linear, a GELU(tanh) MLP without
a gate (c_fc, c_proj), the sliding window of its config on every layer, a tied head; rotary over whole heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.models.layernorm_family import PlainMLP, partial_rotary_attention
from pagedllm.model.models.llama import LayerStack, LlamaForCausalLM, layer_window


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch, index: int) -> None:
        super().__init__()
        bias, eps = bool(getattr(config, "use_bias", True)), config.norm_epsilon
        self.self_attn = partial_rotary_attention(config, dtype, bias, kernels, layer_window(config, index), bias)
        self.mlp = PlainMLP(config, dtype, kernels, ("c_fc", "c_proj"), bias)
        self.input_layernorm = LayerNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: Any) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Starcoder2Model(LayerStack):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, qk_norm: bool, kernels: KernelDispatch) -> None:
        layers = (Starcoder2DecoderLayer(config, dtype, kernels, i) for i in range(config.num_hidden_layers))
        super().__init__(config, dtype, kernels, layers, LayerNorm(config.hidden_size, config.norm_epsilon, dtype))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj")
        return LayerDescription(norm="layer", linears=linears, mlp="plain", act="gelu_tanh")

    # its q/k/v (and their biases) merge as Llama's; c_fc and c_proj load as they are
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
