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
