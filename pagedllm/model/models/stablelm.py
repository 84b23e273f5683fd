"""StableLM (StableLmForCausalLM: StableLM 2, StableLM-3B-4E1T): LayerNorm (with bias) before attention and the MLP,
or one LayerNorm feeding both in parallel (`use_parallel_residual`), q/k/v biases (`use_qkv_bias`), rotary over the
first `partial_rotary_factor` of each head, Llama's SiLU-gated MLP. Per-head q/k LayerNorm (`qk_layernorm`, the 12B)
is not supported."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.layernorm_family import LayerNormModel
from pagedllm.model.models.llama import LlamaForCausalLM


class StableLmModel(LayerNormModel):
    o_bias = False

    def __init__(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch
    ) -> None:
        if getattr(config, "qk_layernorm", False):
            raise ValueError("StableLM with qk_layernorm (per-head query/key LayerNorm) is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"StableLM MLP activation {config.hidden_act!r} is not supported (silu is)")
        super().__init__(config, dtype, bool(getattr(config, "use_qkv_bias", False)), desc, kernels)


class StableLmForCausalLM(LlamaForCausalLM):
    model_cls = StableLmModel

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        parallel = bool(getattr(config, "use_parallel_residual", False))
        norms = ("input_layernorm", None if parallel else "post_attention_layernorm", None, None)
        return LayerDescription(norm="layer", norms=norms, parallel=parallel)
