"""HF architecture name -> model class. A new model is one file under models/ and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front end reads this table without importing torch
    from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
}

# GGUF `general.architecture` / HF `model_type` -> architecture name
MODEL_TYPES: dict[str, str] = {
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gpt-oss": "GptOssForCausalLM",  # llama.cpp's name
    "granite": "GraniteForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi": "PhiForCausalLM",
    "phi2": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",  # llama.cpp's name
    "smollm3": "SmolLM3ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """Pick the first supported architecture; ValueError listing the supported ones otherwise."""
    for arch in architectures or []:
        if arch in _MODELS:
            return arch
    if not architectures and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    named = architectures or [model_type]
    raise ValueError(
        f"unsupported model architecture {named}; supported architectures: {', '.join(supported_architectures())}"
    )


def get_model_class(architecture: str) -> type[nn.Module]:
    module, name = _MODELS[resolve_architecture([architecture], None)]
    return getattr(importlib.import_module(f"pagedllm.model.models.{module}"), name)
