"""OLMo 2 (Olmo2ForCausalLM): the Llama layers with the norms moved, as transformers' modeling_olmo2 has them: no
norm before attention or the MLP; each one's output normalised (post_attention_layernorm,
post_feedforward_layernorm) before it joins the residual stream; queries and keys normalised over the whole
projection (all heads at once, before rotary), not per head. All of it is its layer description, which the layer
path and the fused decoder run. One rank only (a norm over all heads would need the ranks' sums).
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel


class Olmo2Model(LlamaModel):
    display_name = "OLMo 2"  # one rank only: LlamaModel refuses full q/k norms split over ranks


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(
            norms=(None, None, "post_attention_layernorm", "post_feedforward_layernorm"), qk_norm="full"
        )
