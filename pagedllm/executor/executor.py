"""Executor: the engine core's handle on compute. `UniProcExecutor` drives one worker in-process.

Tensor parallelism will add an executor that broadcasts each SchedulerOutput to worker processes; nothing
above this interface changes.
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        pass
