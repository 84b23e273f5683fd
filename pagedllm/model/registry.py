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
    # pooling models (embedders, cross-encoders, score heads): --runner pooling
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "LlamaForSequenceClassification": ("seq_cls", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("seq_cls", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("seq_cls", "Qwen3ForSequenceClassification"),
}
# The pooling architectures: what they serve ("embed": embeddings; "classify": a head's scores) and whether they are
# encoders (bidirectional attention, no KV cache). Every other architecture generates, or pools with --convert.
POOLING_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "BertModel": ("embed", True),
    "RobertaModel": ("embed", True),
    "XLMRobertaModel": ("embed", True),
    "BertForSequenceClassification": ("classify", True),
    "RobertaForSequenceClassification": ("classify", True),
    "XLMRobertaForSequenceClassification": ("classify", True),
    "LlamaForSequenceClassification": ("classify", False),
    "Qwen2ForSequenceClassification": ("classify", False),
    "Qwen3ForSequenceClassification": ("classify", False),
}
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

# GGUF `general.architecture` / HF `model_type` -> architecture name
MODEL_TYPES: dict[str, str] = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
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


def pooling_tasks(kind: str) -> tuple[str, ...]:
    """The tasks a pooling model of `kind` serves: an embedder embeds (and scores by cosine), a classifier
    classifies and scores with its head; both give their pooled states (encode)."""
    return ("embed", "score", "encode") if kind == "embed" else ("classify", "score", "encode")


def resolve_runner(architecture: str, runner: str = "auto", convert: str = "auto") -> tuple[str, str | None, str]:
    """(runner, pooling kind or None, the architecture to build) for `--runner` and `--convert` as vLLM reads them:
    auto runs a pooling architecture as a pooling model and anything else as a generator; `--runner pooling` (or
    `--convert embed`) makes a causal LM an embedder of its final hidden states; `--convert classify` reads a causal
    LM's checkpoint as its *ForSequenceClassification (a `score` head). ValueError naming a combination that cannot
    run."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    pooling = POOLING_ARCHITECTURES.get(architecture)
    if pooling is not None:
        if runner == "generate":
            raise ValueError(
                f"{architecture} is a pooling model ({pooling[0]}): it cannot generate text; serve it with "
                "--runner pooling (the default for it)"
            )
        if convert not in ("auto", "none", pooling[0]):
            raise ValueError(f"{architecture} is a {pooling[0]} model; --convert {convert} does not apply to it")
        return "pooling", pooling[0], architecture
    if convert in ("auto", "none"):
        if runner != "pooling":
            return "generate", None, architecture
        convert = "embed"
    if runner == "generate":
        raise ValueError(f"--convert {convert} makes a pooling model: it needs --runner pooling (or auto)")
    if convert == "embed":
        return "pooling", "embed", architecture
    target = architecture.replace("ForCausalLM", "ForSequenceClassification")
    if target not in POOLING_ARCHITECTURES:
        known = ", ".join(
            a for a in POOLING_ARCHITECTURES if "ForSequence" in a and not a.startswith(("Bert", "Rob", "XLM"))
        )
        raise ValueError(
            f"--convert classify is not supported for {architecture} (it is for the causal LMs of {known})"
        )
    return "pooling", "classify", target
