"""EngineCore: the step loop. schedule -> execute_model -> [grammar bitmask -> sample_tokens] -> update_from_output.

`execute_model` runs the forward pass and, when no request of the step samples under a grammar, samples too and
returns the ModelRunnerOutput. Otherwise it returns None and keeps the logits: the scheduler's grammar output (the
bitmask of the constrained requests, computed on the step thread while the forward pass runs on this one) goes
to `sample_tokens`, which samples (the seeds' split). Apart from that split, and the short wait when only grammars
being compiled are left, a feature adds a field to SchedulerOutput/ModelRunnerOutput or a method on a component,
not a branch to `step`. The process wrapper (EngineCoreProc) drives the same object from its busy loop.

The express lane (an encoder pooling model whose worker runs in this process): `install_express(poll)` has `poll`
called between two layers of every encoder step, and twice within each (models/bert.py); the process wrapper's poll
takes the requests that arrived meanwhile and calls `express_step`, which computes the waiting requests of short API
calls (a query; the scheduler's `schedule_express`) in a step of their own and returns their outputs at once. A lone
query then waits for a third of a layer of a big step, not for the rest of that step and a whole step more.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig, express_tokens
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.executor.abstract import Executor
from pagedllm.lora.request import LoRARequest
from pagedllm.model.heap import trim_heap
from pagedllm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        mc = config.model_config
        logger.info(
            "Loading %s (%s, %s, max_model_len=%d)",
            mc.model,
            mc.architecture,
            str(mc.dtype).removeprefix("torch."),
            mc.max_model_len,
        )
        self.executor = Executor.get_class(config)(config)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_cache(self.num_blocks)
        kv_windows = tuple(self.executor.collective_rpc("kv_cache_windows")[0])
        self.structured_output_manager = StructuredOutputManager(
            config.model_config, reasoning_parser=config.reasoning_parser
        )
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            self.num_blocks,
            self.structured_output_manager,
            config.speculative_config,
            kv_windows,
            0 if config.lora_config is None else config.lora_config.max_loras,
        )
        # Adapters unloaded while requests still used them: dropped by the workers once those finish.
        self._loras_to_remove: set[int] = set()
        self._loras: dict[int, LoRARequest] = {}  # the adapters the workers hold, by id
        # Computes the grammar bitmask of a step with constrained requests while this thread runs its forward pass.
        self._step_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-step")
        self.max_model_len = config.model_config.max_model_len
        self.sleep_level = 0  # 0 awake; 1 weights aside, KV cache freed; 2 executor gone (sleep())
        self.froze_gc = False  # whether start-up froze the collector (core_proc.py): level 2 unfreezes, wake refreezes
        self._express_poll: Callable[[], None] | None = None  # install_express's hook
        logger.info("Engine core ready in %.1f s", time.perf_counter() - start)

    def install_express(self, poll: Callable[[], None]) -> bool:
        """Have `poll` called between (and within) the layers of every encoder step, where it may call
        `express_step` (see the module's docstring); again after a level-2 sleep rebuilds the worker. Only for an
        encoder pooling model whose worker runs in this process, with the lane on ($PAGEDLLM_EXPRESS_TOKENS); False
        where it does not apply."""
        from pagedllm.executor.uniproc import UniProcExecutor

        mc = self.config.model_config
        if mc.runner != "pooling" or not mc.is_encoder or not isinstance(self.executor, UniProcExecutor):
            return False
        if not self.scheduler.enable_express(express_tokens()):
            return False
        self._express_poll = poll
        self.executor.collective_rpc("set_poll_hook", (poll,))
        return True

    def express_step(self) -> EngineCoreOutputs:
        """Inside an encoder step (from the express poll): the waiting requests of short calls, computed now in a step
        of their own; their outputs (empty when there are none)."""
        sched = self.scheduler.schedule_express()
        if sched is None:
            return EngineCoreOutputs()
        model_output = self.executor.execute_model(sched)
        assert model_output is not None  # a pooling step samples nothing
        return self.scheduler.update_from_output(sched, model_output)

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.sleep_level:  # the front ends refuse or wake first; a request that still arrives wakes the engine
            logger.warning("a request arrived while the engine was asleep: waking it up")
            self.wake_up()
        params = request.sampling_params
        room = self.max_model_len - len(request.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, max(room, 1))
        self.scheduler.add_request(Request.from_engine_core_request(request, max_tokens))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.structured_output_request_ids:
            # The grammar bitmask is computed on the step thread while the forward pass runs here (the grammars are
            # where the last step left them; the forward pass reads only the scheduler output). Not the other way
            # round: the forward pass on another thread would start a second OpenMP team, which made even steps
            # without grammars 25% slower.
            bitmask = self._step_thread.submit(self.scheduler.get_grammar_output, scheduler_output)
            model_output = self.executor.execute_model(scheduler_output)
            grammar_output = bitmask.result()
            if model_output is None:  # constrained requests sample in this step
                model_output = self.executor.sample_tokens(grammar_output)
        else:
            model_output = self.executor.execute_model(scheduler_output)
            if model_output is None:
                model_output = self.executor.sample_tokens(None)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self._loras_to_remove:
            self._remove_unused_loras()
        if scheduler_output.is_empty:  # nothing could run: only grammars being compiled; wait for one
            self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
        return outputs

    # ---- utility calls (also reachable over the process boundary) ----------------------------------

    def get_scheduler_stats(self) -> SchedulerStats:
        """Scheduler stats outside a step (the front end asks when aborts left it idle: the stats of the last
        step still counted the aborted requests). Counters since the last report, no scheduled tokens."""
        stats = self.scheduler.make_stats()
        stats.num_scheduled_tokens = 0
        return stats

    def get_structured_output_stats(self) -> dict[str, float]:
        """Time the structured-output manager spent on bitmasks (seconds, steps, rows) since start-up, and the
        forced tokens verified as drafts (and accepted)."""
        drafts, accepted = self.scheduler.forced_draft_counts
        return {**self.structured_output_manager.stats(), "forced_drafts": drafts, "forced_accepted": accepted}

    def check_health(self) -> None:
        """Raise if the executor lost a worker."""
        self.executor.check_health()

    def _workers(self) -> Executor:
        """The executor, its workers started again first if they were stopped by a level-2 sleep (a call that needs
        them wakes the engine, as a request does)."""
        if self.sleep_level == 2:
            logger.warning("a call to the workers arrived while the engine slept at level 2: waking it up")
            self.wake_up()
        return self.executor

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """A Worker method run on every rank (through the executor); the results in rank order."""
        return self._workers().collective_rpc(method, tuple(args or ()))

    def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter on every rank (a LoRARequest, or its fields as a list); ValueError naming what is
        wrong with it. False when it was loaded already."""
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters need --enable-lora")
        if not isinstance(lora_request, LoRARequest):
            lora_request = LoRARequest(*lora_request)
        lid = lora_request.lora_int_id
        known = self._loras.get(lid)
        if known is not None and (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
            if lid in self._loras_to_remove:
                raise ValueError(
                    f"lora_int_id {lid} is adapter {known.lora_name!r}, being unloaded while requests still use it; "
                    f"give {lora_request.lora_name!r} another id"
                )
            self._workers().collective_rpc("remove_lora", (lid,))  # replaced by another adapter of that id
        self._loras_to_remove.discard(lid)
        added = any(self._workers().collective_rpc("add_lora", (lora_request,)))
        self._loras[lid] = lora_request
        return added

    def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter `lora_id`; requests still running with it finish first (it is dropped after them)."""
        if any(r.lora_id == lora_id for r in self.scheduler.requests.values()):
            self._loras_to_remove.add(lora_id)
            return True
        self._loras.pop(lora_id, None)
        return any(self._workers().collective_rpc("remove_lora", (lora_id,)))

    def list_loras(self) -> list[int]:
        """The ids of the adapters the workers hold in memory."""
        return sorted(self._workers().collective_rpc("list_loras")[0])

    def _remove_unused_loras(self) -> None:
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        for lora_id in list(self._loras_to_remove - in_use):
            self._loras_to_remove.discard(lora_id)
            self._loras.pop(lora_id, None)
            self.executor.collective_rpc("remove_lora", (lora_id,))

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory without stopping it (vLLM's sleep mode). Level 1: the KV cache is freed and the
        weights wait in the page cache (a temporary file mapped over them), mapped back by `wake_up` at once.
        Level 2: the workers are stopped (everything but the config goes); `wake_up` starts them again, as at
        start-up. Either way the prefix cache starts cold after it. Only an idle engine sleeps (ValueError
        naming the requests in flight); a deeper level than the current one applies, a shallower one does nothing."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        busy = self.scheduler.get_num_unfinished_requests()
        if busy:
            raise ValueError(f"the engine has {busy} requests in flight: it sleeps once they finish")
        if level <= self.sleep_level:
            return
        start = time.perf_counter()
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():  # its pages are about to read as zeros
            raise RuntimeError("the prefix cache could not be emptied: the engine does not sleep")
        if level == 1:
            self.executor.collective_rpc("sleep")
        else:
            self.executor.shutdown()
            self.executor = Executor(self.config)  # no ranks: health checks pass, nothing runs until wake_up
            if self.froze_gc:
                gc.unfreeze()  # what start-up froze (engine/core_proc.py) may now be collected
            gc.collect()
            trim_heap()
        self.sleep_level = level
        logger.info("engine asleep (level %d) in %.2f s", level, time.perf_counter() - start)

    def wake_up(self) -> None:
        """Back from `sleep`: the weights as they were (level 1) or loaded again (level 2); the prefix cache empty."""
        if not self.sleep_level:
            return
        start = time.perf_counter()
        if self.sleep_level == 1:
            self.executor.collective_rpc("wake_up")
        else:
            executor = Executor.get_class(self.config)(self.config)
            try:
                executor.initialize_cache(self.num_blocks)
                for lora in self._loras.values():  # the adapters the workers held before
                    executor.collective_rpc("add_lora", (lora,))
            except BaseException:
                try:  # its workers stop; the engine stays asleep (level 2), a wake may be tried again
                    executor.shutdown()
                except Exception:
                    logger.exception("stopping the workers of a failed wake-up failed")
                raise
            self.executor = executor
            if self._express_poll is not None:
                self.install_express(self._express_poll)
            if self.froze_gc:  # the new model lives until exit: frozen again, as start-up did (core_proc.py)
                gc.collect()
                gc.freeze()
        logger.info("engine awake (from level %d) in %.2f s", self.sleep_level, time.perf_counter() - start)
        self.sleep_level = 0

    def set_num_threads(self, total: int) -> list[int]:
        """Every rank on its share of `total` threads (Worker.set_num_threads); their counts."""
        return self._workers().collective_rpc("set_num_threads", (int(total),))

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> dict[str, Any]:
        """Verify the block pool; returns counts tests can assert on (blocks in use, free)."""
        kv = self.scheduler.kv_cache_manager
        kv.check_invariants()
        return {
            "num_blocks": self.num_blocks,
            "in_use": kv.num_blocks_in_use(),
            "free": kv.get_num_free_blocks(),
            "unfinished": self.scheduler.get_num_unfinished_requests(),
            "num_preemptions": self.scheduler.total_preemptions,
        }

    def shutdown(self) -> None:
        self._step_thread.shutdown(wait=True)
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
