"""Phi (PhiForCausalLM: Phi-1.5, Phi-2): one LayerNorm (with bias) feeding attention and the MLP in parallel, both
outputs added to the residual; q/k/v and the output projection (`dense`) with biases; rotary over the first
`partial_rotary_factor` of each head; a GELU(tanh) MLP without a gate (fc1, fc2); the final `final_layernorm`; a head
with a bias. Per-head q/k LayerNorm (`qk_layernorm`) is not supported."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.linear import RowKinds
from pagedllm.model.models.layernorm_family import LayerNormModel, PlainMLP
from pagedllm.model.models.llama import LlamaForCausalLM


class PhiModel(LayerNormModel):
    o_bias = True

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        if getattr(config, "qk_layernorm", False):
            raise ValueError("Phi with qk_layernorm (per-head query/key LayerNorm) is not supported")
        # q/k/v biases always; the checkpoint's model.final_layernorm loads as `norm` (PhiForCausalLM.hf_renames)
        super().__init__(config, dtype, True, desc, kernels)

    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        return PlainMLP(config, dtype, kernels, desc)


class PhiForCausalLM(LlamaForCausalLM):
    model_cls = PhiModel

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        linears = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.fc1", "mlp.fc2")
        norms = ("input_layernorm", None, None, None)
        return LayerDescription(norm="layer", norms=norms, linears=linears, mlp="plain", act="gelu_tanh", parallel=True)

    hf_renames = ((".self_attn.dense.", ".self_attn.o_proj."), ("model.final_layernorm.", "model.norm."))

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        # the head's bias: the full vocabulary on every rank (the logits are gathered before it is added)
        self.lm_head_bias = nn.Parameter(torch.zeros(config.vocab_size, dtype=dtype), requires_grad=False)
        self.hf_renames = (*self.hf_renames, ("lm_head.bias", "lm_head_bias"))

    def compute_logits(self, hidden: torch.Tensor, rows: RowKinds) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, rows) + self.lm_head_bias
