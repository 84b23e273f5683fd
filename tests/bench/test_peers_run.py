"""bench/peers/run.py refuses to measure pagedllm on plain torch when its native kernels are stale or missing (the
engine itself only warns and falls back), unless PAGEDLLM_CPU_KERNELS=0 asks for plain torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagedllm.model import kernels

RUN_PY = Path(__file__).resolve().parents[2] / "bench" / "peers" / "run.py"


@pytest.fixture()
def run_module():
    spec = importlib.util.spec_from_file_location("peers_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stale_kernels_refuse_the_run(run_module, monkeypatch) -> None:
    def stale(isa: str = "auto"):
        raise kernels.KernelsUnavailable("built from other sources")

    monkeypatch.setattr(kernels, "load_cpu_ops", stale)
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    assert run_module.stale_kernels(["pagedllm-gguf", "vllm"]) == "built from other sources"
    with pytest.raises(SystemExit):
        run_module.main(["--workloads", "uniform", "--engines", "pagedllm,vllm"])
    assert run_module.stale_kernels(["vllm", "llamacpp"]) is None  # no pagedllm engine: nothing to check
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert run_module.stale_kernels(["pagedllm"]) is None  # plain torch on purpose


def test_usable_kernels_pass(run_module, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "load_cpu_ops", lambda isa="auto": object())
    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    assert run_module.stale_kernels(["pagedllm"]) is None
