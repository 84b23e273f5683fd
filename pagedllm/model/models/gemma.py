"""Gemma (the first: GemmaForCausalLM, and GGUF `gemma` files): the Llama layers with Gemma's conventions, as
transformers' modeling_gemma computes them: RMSNorm scaled by (1 + w) (held as that sum), embeddings scaled by
sqrt(hidden) in float32, a GELU(tanh)-gated MLP, a tied head. Its layer description (Llama's norm roles, the GELU
gate) is what the layer path and the fused decoder run.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel


def check_gelu_tanh(config: Any) -> None:
    """Gemma's MLPs run GELU with the tanh approximation; ValueError naming any other activation."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma MLP activation {act!r} is not supported (gelu_pytorch_tanh is)")


class GemmaModel(LlamaModel):
    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        check_gelu_tanh(config)
        super().__init__(config, dtype, bias, desc, kernels)
        self.embed_scale = float(config.hidden_size) ** 0.5


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
    decoder_act = "gelu_tanh"

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        if not hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = True  # Gemma's head is its embedding
        super().__init__(config, dtype, kernels)

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if name.endswith("norm.weight") else tensor
