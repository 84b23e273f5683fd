"""Executor: the engine core's handle on compute, whatever runs it.

Contract. `Executor.get_class(config)` is the class for `parallel_config.distributed_executor_backend`: "uni"
(`UniProcExecutor`: one worker in the engine-core process), "mp" (`MultiprocExecutor`: one worker process per
tensor-parallel rank on this machine) or "ray" (`RayDistributedExecutor`: one Ray actor per rank, anywhere in a
cluster). Every executor offers the same calls: `determine_num_blocks()` (the smallest count any rank can hold),
`initialize_cache(num_blocks)`, `execute_model(scheduler_output)` (rank 0's ModelRunnerOutput, or None when the
step's constrained requests wait for `sample_tokens(grammar_output)`; every rank runs the step),
`collective_rpc(method, args)` (a Worker method on every rank, their results in rank order) and
`check_health()` (raises if a rank is known to be gone; the engine-core process checks while idle) and
`shutdown()` (idempotent; no process or actor is left). A rank that dies or fails raises `RuntimeError` naming it
from the call that was waiting on it (the engine core then dies, and its client raises `EngineDeadError`).
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.protocol import WorkerResponse
from pagedllm.structured_output import GrammarOutput

# distributed_executor_backend -> (module, class)
_EXECUTORS: dict[str, tuple[str, str]] = {
    "uni": ("pagedllm.executor.uniproc", "UniProcExecutor"),
    "mp": ("pagedllm.executor.multiproc", "MultiprocExecutor"),
    "ray": ("pagedllm.executor.ray_executor", "RayDistributedExecutor"),
}


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class of `parallel_config.distributed_executor_backend`, imported on demand (by name, as
        model/registry.py imports models: Ray's module is only loaded when asked for)."""
        backend = config.parallel_config.distributed_executor_backend
        if backend not in _EXECUTORS:
            raise ValueError(f"unknown distributed_executor_backend {backend!r}")
        module, name = _EXECUTORS[backend]
        return getattr(importlib.import_module(module), name)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's forward pass; its output, or None when constrained requests wait for `sample_tokens`."""
        raise NotImplementedError

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step whose execute_model returned None, under the grammar bitmask."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise RuntimeError naming the rank if a worker is gone (cheap: no call to the workers)."""

    def shutdown(self) -> None:
        pass


class RemoteWorkersExecutor(Executor):
    """An executor whose ranks live elsewhere (processes, Ray actors) and speak `WorkerRequest` / `WorkerResponse`:
    subclasses deliver a call with `_call`, this turns the engine's calls into them."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput | None)

    def _call(self, method: str, args: bytes, reply: str) -> list[WorkerResponse]:
        """Run `method` on every rank; the answers asked for by `reply` ("all" or "driver"), in rank order."""
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        answers = self._call(method, self._encoder.encode(list(args)), "all")
        return [msgspec.msgpack.decode(a.result) if a.result else None for a in answers]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        (answer,) = self._call("execute_model", self._encoder.encode(scheduler_output), "driver")
        return self._output_decoder.decode(answer.result)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        (answer,) = self._call("sample_tokens", self._encoder.encode(grammar_output), "driver")
        return self._output_decoder.decode(answer.result)
