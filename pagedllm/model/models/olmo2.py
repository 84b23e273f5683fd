"""OLMo 2 (Olmo2ForCausalLM): the Llama layers with the norms moved, as transformers' modeling_olmo2 has them: no
norm before attention or the MLP; each one's output normalised (post_attention_layernorm,
post_feedforward_layernorm) before it joins the residual stream; queries and keys normalised over the whole
projection (all heads at once, before rotary), not per head. All of it is its layer description, which the layer
path and the fused decoder run. One rank only (a norm over all heads would need the ranks' sums).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel


def require_one_rank(kernels: KernelDispatch, model: str) -> None:
    """ValueError at more than one tensor-parallel rank: q/k norms over the whole projection would need the ranks'
    sums (OLMo 2, OLMoE)."""
    if kernels.tp.world_size > 1:
        raise ValueError(
            f"{model} runs on one rank only: its query/key norms span every head (tensor_parallel_size must be 1)"
        )


class Olmo2Model(LlamaModel):
    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        require_one_rank(kernels, "OLMo 2")
        super().__init__(config, dtype, bias, desc, kernels)


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(
            norms=(None, None, "post_attention_layernorm", "post_feedforward_layernorm"), qk_norm="full"
        )
