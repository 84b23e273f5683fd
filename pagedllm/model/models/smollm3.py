"""SmolLM3: the Llama decoder in which some layers use no rotary embedding (`no_rope_layers[i]` 0: layer i attends
without positions; by default every fourth layer), and optionally sliding windows per layer (`layer_types`, when
`use_sliding_window`). A layer without rope holds an identity rotary table (cos 1, sin 0), which the layer path and
the fused decoder apply exactly as no rotation (x * 1 - y * 0 = x), so both run it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel


class SmolLM3Model(LlamaModel):
    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        super().__init__(config, dtype, bias, desc, kernels)
        flags = list(getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers)
        if len(flags) != config.num_hidden_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {config.num_hidden_layers} layers")
        identity = None
        for layer, use_rope in zip(self.layers, flags, strict=True):
            if use_rope:
                continue
            rope = layer.self_attn.rotary_emb
            if identity is None:
                half = rope.cos_sin_cache.shape[1] // 2
                rows = rope.cos_sin_cache.shape[0]
                identity = torch.cat([torch.ones(rows, half), torch.zeros(rows, half)], dim=1)
            rope.cos_sin_cache = identity


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_cls = SmolLM3Model
