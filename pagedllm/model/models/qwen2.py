"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_bias = True
