"""Llama-family decoder (Llama 2/3, SmolLM2), composed from the parallel-ready layers.

Also the base of Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), which differ only in the
switches below. Contract of every model class:
  forward(input_ids [T], positions [T], attn_metadata) -> hidden states [T, hidden]
  compute_logits(hidden [N, hidden]) -> [N, vocab]
  load_weights(iterable of (HF parameter name, tensor))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.attention import Attention, AttentionMetadata
from pagedllm.model.layers.cpu_kernels import active_for
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.parallel_state import divide, get_tp_world_size
from pagedllm.model.layers.rotary import RotaryEmbedding


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict) from either the top level or `rope_parameters` (transformers 5)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    kind = params.get("rope_type") or params.get("type") or "default"
    return float(theta), (params if kind != "default" else None)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        tp = get_tp_world_size()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.num_heads = divide(total_heads, tp)
        self.num_kv_heads = max(1, total_kv // tp)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv, bias=bias, dtype=dtype)
        # Llama's attention_bias also puts a bias on o_proj; Qwen2's q/k/v biases do not.
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias, dtype=dtype)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, hq + 2 * hkv, self.head_dim)
        v = qkv[:, hq + hkv :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv])], dim=1)
            if not self.rotary_emb.rotate_heads_(positions, qk, hq + hkv):
                qk = self.rotary_emb.rotate(positions, qk)
        elif self.rotary_emb.rotate_heads_(positions, qkv, hq + hkv):
            qk = qkv[:, : hq + hkv]  # rotated in place
        else:
            # Queries and keys rotate in one call: they sit side by side in the fused projection.
            qk = self.rotary_emb.rotate(positions, qkv[:, : hq + hkv])
        return self.o_proj(self.attn(qk[:, :hq], qk[:, hq:], v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        inter = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, bias, qk_norm)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # (layer 0's kv_cache, the native DecodeModel or None where it does not apply), built on first use
        self._fused_plan: tuple[Any, Any] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if x.shape[0] == 1 and meta.num_decodes == 1 and self._fused_decode(positions, x, meta):
            return x
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def _fused_decode(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The whole decoder stack as one native call for a lone decode token, in place on x (single-request
        decode is bound by reading the weights, and per-layer dispatch, thread-team forks and barriers were ~15 %
        of its step); False where that kernel does not apply."""
        ops = active_for(x)
        first = self.layers[0].self_attn
        # The native backend (decode_op set) gives every decode batch one group with seq_lens, in float32.
        if ops is None or first.attn.decode_op is None or first.q_norm is not None or not x.is_contiguous():
            return False
        plan = self._fused_plan
        if plan is None or plan[0] is not first.attn.kv_cache:  # built once per KV cache allocation
            weights = self._fused_decode_weights()
            if not weights:
                self._fused_plan = (first.attn.kv_cache, None)
                return False
            layers = [layer.self_attn for layer in self.layers]
            plan = self._fused_plan = (
                first.attn.kv_cache,
                ops.DecodeModel(
                    weights, [a.attn.kv_cache[0] for a in layers], [a.attn.kv_cache[1] for a in layers],
                    [a.rotary_emb.cos_sin_cache for a in layers], first.attn.scale, self.norm.eps, self.norm.weight,
                ),
            )  # fmt: skip
        if plan[1] is None:
            return False
        (group,) = meta.decode_groups
        plan[1](x, positions, meta.slot_mapping, group.block_table, group.seq_lens)
        return True

    def _fused_decode_weights(self) -> list[torch.Tensor]:
        """`DecodeModel`'s ten tensors per layer (the linear weights as panels, an empty tensor for an absent
        bias), or [] where some layer cannot run fused: no panels, tensor parallelism, a non-float32 rotary table."""
        none = torch.empty(0)
        weights: list[torch.Tensor] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.panels is None or lin.tp_size != 1 for lin in linears):
                return []
            if attn.rotary_emb.cos_sin_cache.dtype != torch.float32 or layer.input_layernorm.eps != self.norm.eps:
                return []
            for norm, lin in ((layer.input_layernorm, attn.qkv_proj), (None, attn.o_proj),
                              (layer.post_attention_layernorm, mlp.gate_up_proj), (None, mlp.down_proj)):  # fmt: skip
                if norm is not None:
                    weights.append(norm.weight)
                weights += [lin.panels.data, none if lin.bias is None else lin.bias]
        return weights


class LlamaForCausalLM(nn.Module):
    attention_bias = False
    qk_norm = False
    # HF checkpoint names -> (our merged parameter, shard id)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        bias = self.attention_bias or bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, dtype, bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through each parameter's weight_loader; returns the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            for merged, part, shard in self.stacked_params:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{merged}.")
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                    param = params[target]
                    param.weight_loader(param, tensor.to(param.dtype), shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor.to(param.dtype))
                loaded.add(name)
        missing = set(params) - loaded
        if self.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(missing)[:8]}")
        return loaded
