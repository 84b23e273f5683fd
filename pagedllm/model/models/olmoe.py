"""OLMoE (OlmoeForCausalLM: OLMoE-1B-7B): Llama's norm placement (before attention and before the MLP), queries
and keys normalised over the whole projection (as OLMo 2), then optionally clamped to +-`clip_qkv` together with
the values, and mixture-of-experts MLPs whose top-k weights are renormalised only where `norm_topk_prob` says (not
in the release). One rank only: its q/k norms span every head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel
from pagedllm.model.models.mixtral import moe_mlp


class OlmoeModel(LlamaModel):
    display_name = "OLMoE"  # one rank only: LlamaModel refuses full q/k norms split over ranks

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        super().__init__(config, dtype, bias, desc, kernels)
        clip = getattr(config, "clip_qkv", None)
        for layer in self.layers:
            layer.self_attn.clip_qkv = float(clip) if clip else None

    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        return moe_mlp(config, dtype, kernels, config.intermediate_size, renormalize)


class OlmoeForCausalLM(LlamaForCausalLM):
    model_cls = OlmoeModel

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(mlp="moe", qk_norm="full")
