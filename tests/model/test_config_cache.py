"""The GGUF config cache (model/config_loader.py): the config metadata of a GGUF file is parsed once and read from
pagedllm's cache afterwards while the file is unchanged; a damaged entry is parsed again, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.config import default_model_path
from pagedllm.model import config_loader


def test_config_metadata_is_cached_and_damage_is_survived(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    first = config_loader.gguf_config_metadata(path)
    (entry,) = (tmp_path / "configs").glob("*.json")
    assert first["general.architecture"] == "llama" and first["llama.block_count"] == 30

    def no_parse(path: str) -> None:
        raise AssertionError("parsed the GGUF file although its config is cached")

    monkeypatch.setattr(config_loader, "read_gguf_metadata", no_parse)
    assert config_loader.gguf_config_metadata(path) == first
    built = config_loader.load_model_config(path).hf_config
    assert (built.num_hidden_layers, built.hidden_size, built.tie_word_embeddings) == (30, 576, True)

    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    entry.write_text('{"key": "truncat')
    assert config_loader.gguf_config_metadata(path) == first  # parsed again, and the entry rewritten
    assert entry.read_text().startswith('{"key": ')


def test_a_packaged_models_name_loads_its_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`pagedllm serve qwen2.5-coder-0.5b-q4_k_m`: a name of model/packaged.py's (not a path) loads the file its
    packages assemble, served under that name; a name that is neither is refused, listing the packaged names."""
    monkeypatch.chdir(tmp_path)  # no file or folder of that name here
    assembled: list[str] = []

    def fake_packaged(name: str) -> str:
        assembled.append(name)
        return default_model_path()

    monkeypatch.setattr(config_loader, "packaged_model", fake_packaged)
    name = next(iter(config_loader.PACKAGED_MODELS))
    config = config_loader.load_model_config(name)
    assert assembled == [name] and config.served_model_name == name
    assert config.hf_config.num_hidden_layers == 30  # the file's own config
    assert config_loader.load_model_config(name, served_model_name="mine").served_model_name == "mine"
    with pytest.raises(ValueError, match=f"does not exist.*{name}"):
        config_loader.load_model_config("no-such-model")
