"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): Llama's norm placement; attention with q/k/v/o biases,
one learned sink logit per head in every softmax (attention sinks), layers alternating between a sliding window
(`layer_types`, 128 tokens) and full attention, YaRN rope; mixture-of-experts MLPs whose router has a bias and takes
the top k logits then a softmax over them, and whose experts have biases and a clamped SwiGLU:
g = min(g, limit), u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha g) (alpha 1.702, limit `swiglu_limit`).

Checkpoint names as transformers 5 holds them (docs/moe-notes.md): `self_attn.sinks` [heads]; `mlp.router.weight`
[E, H] and `.bias` [E]; `mlp.experts.gate_up_proj` [E, H, 2I] in x @ W orientation with gate and up interleaved
(even columns gate, odd up), `gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias` [E, H].
`unfuse` turns them into the MoE layer's [E, 2I, H] (gate rows, then up rows) and [E, H, I]. A GGUF file (llama.cpp's
`gpt-oss`) holds them de-interleaved, per projection (loader.py), its experts usually MXFP4, run as stored; its
yarn rope as llama.cpp runs it (truncated correction dims, config_loader.py). Tensor parallel: the
sinks split with the query heads, the experts' intermediate dimension as every MoE layer's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.model.kernels import KernelDispatch
from pagedllm.model.layers.description import LayerDescription
from pagedllm.model.layers.moe import MoEMLP
from pagedllm.model.models.llama import LlamaForCausalLM, LlamaModel
from pagedllm.model.models.mixtral import num_experts

ALPHA = 1.702  # transformers' swiglu_alpha default; llama.cpp hard-codes it, the released config has no key


class GptOssModel(LlamaModel):
    def build_attention(
        self, config: Any, dtype: torch.dtype, bias: bool, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        attn = super().build_attention(config, dtype, True, desc, kernels, index)
        heads = attn.qkv_proj.heads  # this rank's query heads
        sinks = nn.Parameter(torch.zeros(heads.num_heads, dtype=torch.float32), requires_grad=False)
        total = config.num_attention_heads

        def load_sinks(param: nn.Parameter, tensor: torch.Tensor) -> None:
            if tuple(tensor.shape) != (total,):
                raise ValueError(f"attention sinks of shape {tuple(tensor.shape)}, expected ({total},)")
            param.data.copy_(tensor[heads.first_head : heads.first_head + heads.num_heads])

        sinks.weight_loader = load_sinks
        attn.sinks = sinks
        attn.attn.sinks = sinks  # the attention backends read it from the layer
        return attn

    def build_mlp(
        self, config: Any, dtype: torch.dtype, desc: LayerDescription, kernels: KernelDispatch, index: int
    ) -> nn.Module:
        limit = float(getattr(config, "swiglu_limit", None) or 7.0)
        alpha = float(getattr(config, "swiglu_alpha", None) or ALPHA)
        return MoEMLP(
            config.hidden_size, config.intermediate_size, num_experts(config), int(config.num_experts_per_tok),
            False, dtype, kernels.cpu_for(dtype), kernels.tp, scoring="topk_softmax", act="swiglu_clamp",
            bias=True, alpha=alpha, limit=limit,
        )  # fmt: skip


class GptOssForCausalLM(LlamaForCausalLM):
    attention_bias = True
    model_cls = GptOssModel
    hf_renames = ((".mlp.router.", ".mlp.gate."),)

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, kernels: KernelDispatch | None = None) -> None:
        super().__init__(config, dtype, kernels)
        self._pending_biases: dict[str, dict[str, torch.Tensor]] = {}  # a GGUF's gate / up biases, until paired

    @classmethod
    def layer_description(cls, config: Any) -> LayerDescription:
        return LayerDescription(mlp="moe")

    def unfuse(self, name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """The experts' tensors as the MoE layer holds them: gate|up [E, H, 2I] interleaved -> [E, 2I, H] gate rows
        then up rows, down [E, I, H] -> [E, H, I], and their biases de-interleaved to the layer's bias parameters."""
        if name.endswith(".mlp.experts.gate_up_proj"):
            yield name, torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            yield name, tensor.transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            yield (
                name.replace(".experts.gate_up_proj_bias", ".w13_bias"),
                torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1),
            )
        elif name.endswith(".mlp.experts.down_proj_bias"):
            yield name.replace(".experts.down_proj_bias", ".w2_bias"), tensor
        elif name.endswith((".mlp.experts.gate_proj_bias", ".mlp.experts.up_proj_bias")):
            # a GGUF file's gate and up biases [E, I], separate: the layer's [E, 2I] once both are read
            key = name.rsplit(".", 1)[0]
            pending = self._pending_biases.setdefault(key, {})
            pending[name.rsplit(".", 1)[1]] = tensor
            if len(pending) == 2:
                del self._pending_biases[key]
                joined = torch.cat([pending["gate_proj_bias"], pending["up_proj_bias"]], dim=-1)
                yield key.replace(".mlp.experts", ".mlp.w13_bias"), joined
        else:
            yield from super().unfuse(name, tensor)
