"""The Ray executor on a two-node Ray cluster that the test starts on loopback (one CPU a node): TP=2 spans both
nodes and gives TP=1's greedy tokens, and a rank killed while the engine is idle takes the engine down without a
request; bundles the cluster cannot hold are a clear error within the placement
timeout; the "ray" backend without Ray installed is refused up front, naming the extra. A Ray-backed LLM stops
cleanly (status 0, no stack dump of Ray's SIGTERM handler), also when its cluster went away before the script
ended."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.exceptions import EngineDeadError
from tests.model_utils import make_tiny_model, random_prompts

ENGINE: dict[str, Any] = dict(dtype="float32", num_threads=2, kv_cache_memory_bytes=32 << 20)
HAVE_RAY = importlib.util.find_spec("ray") is not None


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A head and one more node, one CPU each, bound to 127.0.0.1; yields the address."""
    if not HAVE_RAY:
        pytest.skip("ray is not installed (it is in the test extra: pip install -e '.[test]')")
    # Before Ray starts: every node of the cluster binds to 127.0.0.1, never the machine's interface address.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.mark.timeout(600)
def test_tp2_across_two_ray_nodes_gives_tp1_tokens(
    ray_cluster: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=11)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([4, 21, 33], seed=3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    single = LLM(model=folder, engine_client="inproc", **ENGINE)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    del single
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    llm = LLM(model=folder, tensor_parallel_size=2, **ENGINE)  # $RAY_ADDRESS makes "ray" the default
    try:
        assert llm.config.parallel_config.distributed_executor_backend == "ray"
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        pids = llm.engine_core.call_utility("collective_rpc", "process_id")
        assert len(set(pids)) == 2
        # A rank killed while the engine is idle: the core's idle health check finds it, with no request sent.
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not llm.engine_core.dead and time.monotonic() < deadline:
            time.sleep(0.1)
        assert llm.engine_core.dead
        with pytest.raises(EngineDeadError):
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine_core.shutdown()


@pytest.mark.timeout(300)
def test_bundles_the_cluster_cannot_hold_fail_within_the_timeout(
    ray_cluster: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=11)
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT_TIMEOUT", "5")
    with pytest.raises(RuntimeError, match="Ray could not place 2 bundles of 4 CPU"):
        LLM(model=folder, tensor_parallel_size=2, ray_cpus_per_worker=4, distributed_executor_backend="ray", **ENGINE)


def test_the_ray_backend_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'pagedllm\[ray\]'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray").for_engine_core()


# Two Ray-backed LLMs on a cluster of the script's own: the first dropped while the cluster lives, the second left
# alive while the cluster stops under it, until the interpreter exits.
_OUTLIVE_SCRIPT = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
from ray.cluster_utils import Cluster
from pagedllm import LLM, SamplingParams
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
os.environ["RAY_ADDRESS"] = cluster.address
params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
kw = dict(tensor_parallel_size=2, dtype="float32", num_threads=1, kv_cache_memory_bytes=32 << 20)
llm = LLM(model=sys.argv[1], **kw)
assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
del llm
print("DROPPED", flush=True)
llm = LLM(model=sys.argv[1], **kw)
assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
print("CORE", llm.engine_core.core.proc.pid, flush=True)
cluster.shutdown()
print("CLUSTER DOWN", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_ray_backed_llm_stops_cleanly_also_after_its_cluster_is_gone(tiny_model_dir: Path) -> None:
    if not HAVE_RAY:
        pytest.skip("ray is not installed (it is in the test extra: pip install -e '.[test]')")
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=11)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_OUTLIVE_SCRIPT), folder],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the log lines and the script's marks in the order they came
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert "SIGTERM received" not in out, out[-4000:]  # Ray's stack dump of a signal it treats as a crash
    dropped, _, rest = out.partition("DROPPED")
    # dropped with its cluster alive: an ordinary stop, status 0
    assert "engine core process stopped (exit status 0)" in dropped, dropped[-3000:]
    assert "CLUSTER DOWN" in rest
    core_pid = int(rest.split("CORE ", 1)[1].split()[0])
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{core_pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{core_pid}"), "the engine core outlived the script"
