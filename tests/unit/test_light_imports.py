"""What `pagedllm serve` imports before its engine core starts, and what the front end needs for a GGUF model.

The CLI starts the engine-core process before the front end's heavy imports, so that the two load side by side
(startup, bench/RESULTS.md); and the front end of a GGUF model never needs torch at all. Each check runs in a fresh
interpreter: what this test process has imported says nothing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.tokenizer import get_tokenizer


def _modules_after(code: str) -> set[str]:
    """The top-level modules loaded after running `code` in a fresh interpreter."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


@pytest.mark.timeout(180)
def test_the_serve_launch_path_imports_neither_torch_nor_transformers() -> None:
    loaded = _modules_after(
        "from pagedllm.entrypoints.cli import build_parser\n"
        "from pagedllm.engine.arg_utils import EngineArgs\n"
        "import pagedllm.engine.core_process, zmq.asyncio\n"
        "ns = build_parser().parse_args(['serve', '--port', '0'])\n"
        "EngineArgs.from_cli_args(ns).for_engine_core()\n"
    )
    assert "pagedllm" in loaded and "zmq" in loaded
    assert not loaded & {"torch", "transformers", "numpy", "fastapi"}


@pytest.mark.timeout(180)
def test_the_front_end_of_a_gguf_model_does_not_import_torch() -> None:
    # The server module, the model config and the tokenizer, from the conversion cache (filled here first: the
    # conversion itself, once per file, goes through transformers' AutoTokenizer, which imports torch).
    get_tokenizer(EngineArgs().create_model_config())
    loaded = _modules_after(
        "import pagedllm.entrypoints.openai.api_server\n"
        "from pagedllm.engine.arg_utils import EngineArgs\n"
        "from pagedllm.tokenizer import get_tokenizer\n"
        "tok = get_tokenizer(EngineArgs().for_engine_core().create_model_config())\n"
        "assert tok.eos_token_id is not None\n"
    )
    assert "fastapi" in loaded and "transformers" in loaded
    assert "torch" not in loaded


@pytest.mark.timeout(180)
def test_a_gguf_model_config_needs_no_transformers() -> None:
    loaded = _modules_after(
        "from pagedllm.engine.arg_utils import EngineArgs\n"
        "mc = EngineArgs().for_engine_core().create_model_config()\n"
        "assert mc.hf_config.num_hidden_layers == 30 and mc.dtype == 'float32'\n"
    )
    assert not loaded & {"torch", "transformers"}
