"""Mixtral (MixtralForCausalLM): the Mistral decoder whose MLP is a mixture of experts: a router over
`num_local_experts` SiLU-gated experts, the top `num_experts_per_tok` of each token's softmax renormalised
(model/layers/moe.py). Checkpoints name the block `block_sparse_moe` and each expert's projections w1 (gate), w3
(up) and w2 (down): `hf_renames` maps them to the MoE layer's names. The experts run on the fused experts kernel, in
the fused decoder for decode steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.moe import MoEMLP
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel


def num_experts(config: Any) -> int:
    """The experts of a MoE layer: `num_local_experts` (Mixtral, and Qwen3-MoE configs written by transformers 5)
    or `num_experts` (Qwen's and OLMoE's released configs)."""
    n = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not n:
        raise ValueError("a mixture-of-experts config needs num_local_experts or num_experts")
    return int(n)


def moe_mlp(config: Any, dtype: torch.dtype, kernels: KernelDispatch, inter: int, renormalize: bool) -> MoEMLP:
    """A MoE layer of the config's experts and top-k, each expert `inter` wide (SiLU-gated only)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"expert activation {act!r} is not supported (silu is)")
    top_k = int(config.num_experts_per_tok)
    ops, tp = kernels.cpu_for(dtype), kernels.tp
    return MoEMLP(config.hidden_size, inter, num_experts(config), top_k, renormalize, dtype, ops, tp)


class MixtralModel(LlamaModel):
    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        return moe_mlp(config, dtype, kernels, config.intermediate_size, renormalize=True)


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
    hf_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(mlp="moe")
