"""Tokenizer loading: from an HF folder, or from a GGUF file's metadata (via transformers), never a hub."""

from __future__ import annotations

from typing import Any

from pagedllm.config import ModelConfig


def get_tokenizer(model_config: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if model_config.gguf_file:
        kwargs["gguf_file"] = model_config.gguf_file
    return AutoTokenizer.from_pretrained(model_config.tokenizer, **kwargs)


def eos_token_id(tokenizer: Any, hf_config: Any) -> int | None:
    if getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos
