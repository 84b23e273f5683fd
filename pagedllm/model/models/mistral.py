"""Mistral: architecturally the Llama decoder (its sliding window is handled by capping max_model_len)."""

from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
