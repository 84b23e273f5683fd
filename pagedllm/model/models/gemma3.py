"""Gemma 3 (text: Gemma3ForCausalLM, and the text model of a GGUF `gemma3` file) on the Llama layers.

What differs from Llama, as transformers' modeling_gemma3 computes it:
* RMSNorm scales by (1 + w): every norm weight is loaded as 1 + w (the checkpoint holds w), so the RMSNorm layer and
  its kernels run unchanged; the products are the same float32 values.
* norms around each block: input and post-attention norms around attention, pre- and post-feedforward norms around
  the MLP, each block's output added to the residual after its post norm;
* embeddings scaled by sqrt(hidden) (in float32), a tied head;
* per-head RMSNorm on queries and keys before rotary, the attention scale query_pre_attn_scalar ** -0.5;
* local (sliding-window) and global layers (`layer_types`), each kind with its own rope (`rope_parameters` per layer
  type: a local base of 10,000, a global one of 1,000,000 with optional scaling);
* a GELU(tanh)-gated MLP, and the optional final-logit soft-capping (logits = cap * tanh(logits / cap)).
The layer path and the fused decoder run these layers from the description below (`decoder_norms`, `decoder_act`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.linear import RowKinds
from pagedllm.model.models.gemma import GemmaForCausalLM, GemmaModel
from pagedllm.model.models.llama import LlamaAttention, layer_window


def gemma3_layer_types(config: Any) -> list[str]:
    """Each layer's kind: the config's `layer_types`, else every `sliding_window_pattern`-th layer (default 6)
    global and the others local, as Gemma 3 checkpoints and llama.cpp lay them out."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or 6)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config.num_hidden_layers)
    ]


def gemma3_rope(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling dict or None) of a layer kind: `rope_parameters[layer_type]` (transformers 5), else the
    older top-level `rope_theta` / `rope_scaling` for global layers and `rope_local_base_freq` for local ones."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        p = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        p = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    else:
        p = dict(getattr(config, "rope_scaling", None) or {})
        p.setdefault("rope_theta", getattr(config, "rope_theta", 1000000.0))
    kind = p.get("rope_type") or p.get("type") or "default"
    return float(p.get("rope_theta", 10000.0)), (p if kind != "default" else None)


class Gemma3Model(GemmaModel):
    """Gemma 3's stack: Gemma's, with layers of two kinds (`layer_types`), each kind with its own rope, the attention
    scale query_pre_attn_scalar ** -0.5, and Gemma 2's attention-logit soft-cap where the config has one."""

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with bidirectional attention (an embedding model) is not supported here")
        self.kinds = self.layer_types(config)
        super().__init__(config, dtype, bias, desc, kernels)  # layers of one kind share one rotary table
        softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)  # Gemma 2's; Gemma 3 has none
        for layer in self.layers:
            layer.self_attn.attn.logit_softcap = softcap

    def build_attention(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        rope = self.rope(config, self.kinds[index])  # the layer kind's (built once: not the config's, then this)
        attn = LlamaAttention(config, dtype, False, desc.qk_norm, kernels, layer_window(config, index), rope=rope)
        attn.attn.scale = float(getattr(config, "query_pre_attn_scalar", None) or attn.head_dim) ** -0.5
        return attn

    @staticmethod
    def rope(config: Any, kind: str) -> tuple[float, dict[str, Any] | None]:
        return gemma3_rope(config, kind)

    @staticmethod
    def layer_types(config: Any) -> list[str]:
        return gemma3_layer_types(config)


class Gemma3ForCausalLM(GemmaForCausalLM):  # its (1 + w) norms held as the sum (convert_weight)
    qk_norm = True
    model_cls = Gemma3Model
    # The layers' description (model/layers/description.py): the norms by role (before attention, before the MLP,
    # after attention, after the MLP) and the gate's activation.
    decoder_norms = (
        "input_layernorm",
        "pre_feedforward_layernorm",
        "post_attention_layernorm",
        "post_feedforward_layernorm",
    )
    decoder_act = "gelu_tanh"

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)  # Gemma's: tied by default
        self.softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    def compute_logits(self, hidden: torch.Tensor, rows: RowKinds) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden, rows)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
