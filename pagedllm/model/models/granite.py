"""Granite (IBM Granite 3.x dense): the Llama decoder with four multipliers from its config, as transformers'
modeling_granite applies them: embeddings times `embedding_multiplier`; each attention and MLP output times
`residual_multiplier` before it joins the residual stream; the attention scale `attention_multiplier` (instead of
head_dim ** -0.5); logits divided by `logits_scaling`. The residual multiplier is in the layer description, which
the layer path and the fused decoder read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.linear import RowKinds
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel


class GraniteModel(LlamaModel):
    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        super().__init__(config, dtype, bias, desc, kernels)
        multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        self.embed_scale = multiplier if multiplier != 1.0 else None  # embed() and the fused decoder apply it
        scale = float(getattr(config, "attention_multiplier", 0.0) or 0.0)
        for layer in self.layers:
            if scale:
                layer.self_attn.attn.scale = scale


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        multiplier = float(getattr(config, "residual_multiplier", 1.0))
        return dataclasses.replace(super().layer_description(config), residual_multiplier=multiplier)

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0) or 1.0)

    def compute_logits(self, hidden: torch.Tensor, rows: RowKinds) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden, rows)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits
