"""OLMo 2 (Olmo2ForCausalLM): the Llama layers with the norms moved, as transformers' modeling_olmo2 has them: no
norm before attention or the MLP; each one's output normalised (post_attention_layernorm,
post_feedforward_layernorm) before it joins the residual stream; queries and keys normalised over the whole
projection (all heads at once, before rotary), not per head. One rank only (a norm over all heads would need the
ranks' sums). Its layer description says so to the fused decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.models.llama import LayerStack, LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch) -> None:
        super().__init__(config, dtype, bool(getattr(config, "attention_bias", False)), False, kernels)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps, dtype)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: Any) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : hq * d].contiguous()).view(n, hq, d)
        k = self.k_norm(qkv[:, hq * d : (hq + hkv) * d].contiguous()).view(n, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        qk = torch.cat([q, k], dim=1)
        if not self.rotary_emb.rotate_heads_(positions, qk, hq + hkv):
            qk = self.rotary_emb.rotate(positions, qk)
        return self.o_proj(self.attn(qk[:, :hq], qk[:, hq:], v, meta))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelDispatch) -> None:
        super().__init__()
        ops = kernels.cpu_for(dtype)
        self.self_attn = Olmo2Attention(config, dtype, kernels)
        self.mlp = LlamaMLP(config, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: Any) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(LayerStack):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, qk_norm: bool, kernels: KernelDispatch) -> None:
        if kernels.tp.world_size > 1:
            raise ValueError(
                "OLMo 2 runs on one rank only: its query/key norms span every head (tensor_parallel_size must be 1)"
            )
        layers = (Olmo2DecoderLayer(config, dtype, kernels) for _ in range(config.num_hidden_layers))
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels.cpu_for(dtype))
        super().__init__(config, dtype, kernels, layers, norm)


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(
            norms=(None, None, "post_attention_layernorm", "post_feedforward_layernorm"), qk_norm="full"
        )
