"""Mistral: architecturally the Llama decoder, with its sliding window (config `sliding_window`) on every layer: a
query attends only the last `sliding_window` keys, at the model's full context (model/models/llama.py,
`layer_window`)."""

from __future__ import annotations

from pagedllm.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
