"""Loading the native CPU kernels (pagedllm/model/kernels.py) and what the engine does without them.

The build the install made is present and current wherever a compiler exists; an unknown ISA is a ValueError; a
missing build, a build older than its sources, or a CPU without the ISA is a KernelsUnavailable saying why; and an
engine whose kernels cannot load runs on plain torch (the same tokens as HF), saying so once in its log, while an
explicit `attention_backend="cpu_native"` is refused with a ValueError naming it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model import kernels
from pagedllm.model.kernels import ISAS, KernelsUnavailable, available_isas, detect_isa, load_cpu_ops
from tests.model_utils import hf_greedy, make_tiny_model, random_prompts

needs_build = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler, so no native kernels")


@needs_build
def test_the_install_built_every_isa_this_cpu_runs() -> None:
    best = detect_isa()
    assert available_isas() == list(ISAS[ISAS.index(best) :])
    ops = load_cpu_ops()  # raises if the build is older than its sources
    assert ops.isa == best and ops.panel_width() in (8, 16, 32)


def test_unknown_isa_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="'sse9'"):
        load_cpu_ops("sse9")


@needs_build
def test_missing_or_stale_builds_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernels, "source_hash", lambda: "0123456789abcdef")
    with pytest.raises(KernelsUnavailable, match="built from other sources"):
        load_cpu_ops()
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "_PACKAGE_DIR", str(tmp_path))
    with pytest.raises(KernelsUnavailable, match="make setup"):
        load_cpu_ops("generic")


@needs_build
def test_a_cpu_without_the_isa_is_refused() -> None:
    if detect_isa() == ISAS[0]:
        pytest.skip("this CPU runs every build")
    above = ISAS[ISAS.index(detect_isa()) - 1]  # the next build up, which this CPU lacks
    assert kernels._library(above) is not None, "the install builds every x86-64 ISA, whatever the CPU"
    with pytest.raises(KernelsUnavailable, match=f"cannot run the {above} kernels"):
        load_cpu_ops(above)


def test_without_kernels_the_engine_runs_on_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tiny_model_dir: Path
) -> None:
    from pagedllm.worker import model_runner

    def unavailable(isa: str = "auto") -> None:
        raise KernelsUnavailable("the native CPU kernels are not built (test)")

    monkeypatch.setattr(model_runner, "load_cpu_ops", unavailable)
    folder = make_tiny_model(tiny_model_dir, "LlamaForCausalLM", seed=1)
    prompts = random_prompts([5, 17], seed=3)
    engine = dict(dtype="float32", num_threads=1, engine_client="inproc", max_model_len=64)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        with LLM(folder, **engine, kv_cache_memory_bytes="4MiB") as llm:
            runner = llm.engine_core.engine_core.executor.worker.model_runner
            assert runner.attn_backend.name == "torch" and runner.decode_runner is None
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0))
    said = [r for r in caplog.records if "not built (test)" in r.getMessage()]
    assert len(said) == 1 and "plain torch" in said[0].getMessage()
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(folder, prompts, 8)
    with pytest.raises(ValueError, match="cpu_native"):
        LLM(folder, **engine, attention_backend="cpu_native", kv_cache_memory_bytes="4MiB")
