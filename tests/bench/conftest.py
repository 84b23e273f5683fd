"""Fixtures of the benchmark tests: the tiny random Llama (its WordLevel tokenizer encodes "t5 t6 ..." back to
exactly the ids it decoded from, so prompt lengths are exact), a copy of it with a chat template for the chat
endpoint, and a ShareGPT-format file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.model_utils import make_tiny_model

# The prompt's words, then a space: enough for /v1/chat/completions on a model that has no template.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir: Path) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM")


@pytest.fixture(scope="session")
def tiny_chat_llama(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny_chat") / "tiny-chat-llama"
    shutil.copytree(tiny_llama, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama: str) -> Any:
    from pagedllm.benchmarks.datasets import load_tokenizer

    return load_tokenizer(tiny_llama)


# (human prompt, gpt reply) of the usable entries of SHAREGPT, in file order; the tiny tokenizer counts words.
SHAREGPT_PAIRS = [
    ("t10 t11 t12 t13 t14", "t20 t21 t22"),
    ("t30 t31 t32", "t40 t41 t42 t43 t44 t45"),
    ("t50 t51 t52 t53", "t60 t61"),
]
SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": SHAREGPT_PAIRS[0][0]},
            {"from": "gpt", "value": SHAREGPT_PAIRS[0][1]},
            {"from": "human", "value": "t99 t98"},
            {"from": "gpt", "value": "t97"},
        ],
    },
    {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "t7 t8"}, {"from": "human", "value": "t9"}]},
    {
        "id": "b",
        "conversations": [
            {"from": "human", "value": SHAREGPT_PAIRS[1][0]},
            {"from": "gpt", "value": SHAREGPT_PAIRS[1][1]},
        ],
    },
    {"id": "no-conversations"},
    {"id": "empty-reply", "conversations": [{"from": "human", "value": "t5 t6"}, {"from": "gpt", "value": ""}]},
    {"id": "one-turn", "conversations": [{"from": "human", "value": "t5 t6"}]},
    {
        "id": "c",
        "conversations": [
            {"from": "human", "value": SHAREGPT_PAIRS[2][0]},
            {"from": "gpt", "value": SHAREGPT_PAIRS[2][1]},
        ],
    },
]


@pytest.fixture
def sharegpt_file(tmp_path: Path) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    return str(path)
