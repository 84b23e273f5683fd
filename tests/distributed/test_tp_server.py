"""`pagedllm serve -tp 2` end to end: a rank killed with SIGKILL brings the server down cleanly (/health 503, a
non-zero exit, no process left), and a tensor-parallel size the model cannot take is an error at startup that
names the value, with no process left either. Processes are found by a marker in their environment."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.distributed.procs import marked, wait_for
from tests.model_utils import make_tiny_model
from tests.server.server_utils import RemoteServer


@pytest.fixture
def tiny_folder(tiny_model_dir: Path) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=11, max_position_embeddings=1024)


@pytest.mark.timeout(300)
def test_a_killed_rank_brings_the_server_down_cleanly(tiny_folder: str) -> None:
    marker = f"PAGEDLLM_TEST_{uuid.uuid4().hex}"
    srv = RemoteServer("--model", tiny_folder, "-tp", "2", "--dtype", "float32", env={marker: "1"})
    try:
        status, body = srv.request("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        procs = marked(marker)
        assert len(procs) == 4  # the server, the engine core, two ranks
        workers = [p for p in procs if b"worker_proc" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        assert wait_for(lambda: srv.request("GET", "/health")[0] == 503, timeout=10)
        assert srv.proc.wait(timeout=30) != 0
        assert wait_for(lambda: not marked(marker), timeout=20), marked(marker)
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_tensor_parallel_size_the_model_cannot_take_fails_at_startup(tiny_folder: str) -> None:
    marker = f"PAGEDLLM_TEST_{uuid.uuid4().hex}"
    srv = RemoteServer("--model", tiny_folder, "-tp", "8", env={marker: "1"}, start=False)
    try:
        assert srv.proc.wait(timeout=90) == 2
        assert "tensor_parallel_size 8 is larger than the model's 4 attention heads" in srv.log_text()
        assert wait_for(lambda: not marked(marker), timeout=20), marked(marker)
    finally:
        srv.stop(signal.SIGKILL)
