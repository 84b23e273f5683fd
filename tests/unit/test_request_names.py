"""The names a request's `model` may give a one-model server's base model (api_server.request_names)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from pagedllm.entrypoints.openai.api_server import request_names


def _engine(name: str, path: str) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(served_model_name=name, model=path))


def test_the_model_as_given_and_its_path_name_it_unless_a_name_was_chosen() -> None:
    engine = _engine("qwen-q4", "/models/qwen-q4.gguf")
    args = argparse.Namespace(model_tag="./qwen-q4.gguf", model=None, served_model_name=None)
    assert request_names(engine, args) == ["qwen-q4", "./qwen-q4.gguf", "/models/qwen-q4.gguf"]
    args = argparse.Namespace(model_tag=None, model="/models/qwen-q4.gguf", served_model_name=None)
    assert request_names(engine, args) == ["qwen-q4", "/models/qwen-q4.gguf"]  # each name once
    chosen = _engine("coder", "/models/qwen-q4.gguf")
    args = argparse.Namespace(model_tag="./qwen-q4.gguf", model=None, served_model_name="coder")
    assert request_names(chosen, args) == ["coder"]
    args = argparse.Namespace(model_tag=None, model=None, served_model_name="coder", served_model_name_rest=["c2"])
    assert request_names(chosen, args) == ["coder", "c2"]  # vLLM's further names, no path
