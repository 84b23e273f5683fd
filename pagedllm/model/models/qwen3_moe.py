"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with
mixture-of-experts MLPs. Layer i has experts unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`; such layers keep a dense SiLU-gated MLP of `intermediate_size`. Experts are
`moe_intermediate_size` wide; the top-k weights are renormalised where `norm_topk_prob` says (as released).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from pagedllm.model.models.mixtral import moe_mlp, num_experts


def is_moe_layer(config: Any, index: int) -> bool:
    """Whether layer `index` has experts (transformers' Qwen3MoeDecoderLayer rule)."""
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    return index not in dense and num_experts(config) > 0 and (index + 1) % step == 0


class Qwen3MoeModel(LlamaModel):
    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        if not is_moe_layer(config, index):
            return LlamaMLP(config, dtype, kernels, "silu")
        renormalize = bool(getattr(config, "norm_topk_prob", False))
        return moe_mlp(config, dtype, kernels, config.moe_intermediate_size, renormalize)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True
    model_cls = Qwen3MoeModel

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(mlp="moe", qk_norm="head")
