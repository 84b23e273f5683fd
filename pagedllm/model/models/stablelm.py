"""StableLM (StableLmForCausalLM: StableLM 2, StableLM-3B-4E1T): LayerNorm (with bias) before attention and the MLP,
or one LayerNorm feeding both in parallel (`use_parallel_residual`), q/k/v biases (`use_qkv_bias`), rotary over the
first `partial_rotary_factor` of each head, Llama's SiLU-gated MLP. Per-head q/k LayerNorm (`qk_layernorm`, the 12B)
is not supported."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.models.layernorm_family import partial_rotary_attention
from pagedllm.model.models.llama import LayerStack, LlamaForCausalLM, LlamaMLP


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.parallel = bool(getattr(config, "use_parallel_residual", False))
        self.self_attn = partial_rotary_attention(config, dtype, bool(getattr(config, "use_qkv_bias", False)), kernels)
        self.mlp = LlamaMLP(config, dtype, kernels)
        self.input_layernorm = LayerNorm(config.hidden_size, eps, dtype)
        if not self.parallel:
            self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: Any) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.parallel:
            return x + self.self_attn(positions, h, meta) + self.mlp(h)
        x = x + self.self_attn(positions, h, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class StableLmModel(LayerStack):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, qk_norm: bool, kernels: KernelDispatch) -> None:
        if getattr(config, "qk_layernorm", False):
            raise ValueError("StableLM with qk_layernorm (per-head query/key LayerNorm) is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"StableLM MLP activation {config.hidden_act!r} is not supported (silu is)")
        layers = (StableLmDecoderLayer(config, dtype, kernels) for _ in range(config.num_hidden_layers))
        super().__init__(config, dtype, kernels, layers, LayerNorm(config.hidden_size, config.layer_norm_eps, dtype))


class StableLmForCausalLM(LlamaForCausalLM):
    model_cls = StableLmModel

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        parallel = bool(getattr(config, "use_parallel_residual", False))
        norms = ("input_layernorm", None if parallel else "post_attention_layernorm", None, None)
        return LayerDescription(norm="layer", norms=norms, parallel=parallel)
