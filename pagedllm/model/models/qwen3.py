"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys before rotary embedding."""

from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
