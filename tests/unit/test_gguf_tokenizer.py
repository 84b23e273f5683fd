"""A GGUF file's tokenizer when transformers will not read the file's metadata (an architecture it does not model,
e.g. llama.cpp's `olmoe`, or a reader that fails on it, as its gpt-oss reader does on llama.cpp's files): the same
conversion from the file's `tokenizer.ggml.*` fields, in a plain fast tokenizer, gives the same token ids."""

from __future__ import annotations

import os

import pytest


def test_gguf_tokenizer_without_its_model_class_gives_the_same_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from pagedllm.config import default_model_path
    from pagedllm.tokenizer import _convert_gguf_tokenizer

    folder, name = os.path.split(default_model_path())
    reference = _convert_gguf_tokenizer(folder, name)  # AutoTokenizer's: the model's own class

    refused = []

    def refuse(*args: object, **kwargs: object) -> None:
        refused.append(args)
        raise ValueError("GGUF model with architecture olmoe is not supported yet.")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    fallback = _convert_gguf_tokenizer(folder, name)
    assert refused and isinstance(fallback, PreTrainedTokenizerFast)
    for text in ["Hello world, def f(x):\n    return x ** 2", "The capital of France is", "naïve café 日本語 🙂"]:
        assert fallback(text).input_ids == reference(text).input_ids
    assert fallback.eos_token == reference.eos_token
