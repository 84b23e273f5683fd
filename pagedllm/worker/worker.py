"""Worker: owns one device (one tensor-parallel rank): its torch threads, the model runner, and the KV cache memory
budget.

The budget (`kv_cache_memory_bytes`) becomes a number of blocks of `block_size` tokens, which the engine
core hands to the scheduler; the worker then allocates one key and one value tensor per layer. With tensor
parallelism each rank holds its share of the KV heads, so each rank's budget holds as many blocks as any other's;
the executor still takes the smallest count. `--num-threads` is the total of the ranks on one machine: each rank
runs `num_threads // (tensor_parallel_size * data_parallel_size)` torch threads (at least one).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.config import EngineConfig, heap_reuse_enabled
from pagedllm.core.kv_cache_layout import blocks_for_tokens
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.heap import reuse_freed_memory
from pagedllm.structured_output import GrammarOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, tp: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.tp = tp or TensorParallelGroup()
        self.rank = self.tp.rank
        self.device = torch.device(config.device_config.device)
        if self.device.type == "cpu":
            # The machine's threads are shared by every rank of every data-parallel engine.
            ranks = config.parallel_config.world_size_across_dp
            torch.set_num_threads(max(1, config.device_config.num_threads // ranks))
        self.max_threads = torch.get_num_threads()  # what set_num_threads may go back up to
        torch.manual_seed(config.model_config.seed)
        start = time.perf_counter()
        self.model_runner = ModelRunner(config, self.device, self.tp)
        logger.info("startup: model runner %.2f s (kernels, model, weights)", time.perf_counter() - start)
        if self.device.type == "cpu" and heap_reuse_enabled() and reuse_freed_memory():
            # After loading: what loading freed has gone back to the OS; from here on activations reuse the heap.
            logger.info("host memory: freed activations stay in the heap for reuse (PAGEDLLM_HEAP_REUSE=0: off)")

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        max_len = self.config.model_config.max_model_len
        if per_block == 0:  # an encoder keeps no KV cache: blocks for every running request's accounting
            max_seqs = self.config.scheduler_config.max_num_seqs
            return max_seqs * -(-max_len // cache.block_size) + 1
        num_blocks = cache.kv_cache_memory_bytes // per_block
        source = f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
            source = f"num_gpu_blocks_override={num_blocks}"
        # A request of max_model_len tokens must fit alone, or it could never be scheduled (the null block besides,
        # where a window group has one).
        layout = self.model_runner.kv_layout
        chunk = self.config.scheduler_config.max_num_batched_tokens
        need = sum(blocks_for_tokens(w, max_len, chunk, cache.block_size) for w in layout.windows) + layout.hybrid
        if num_blocks < need:
            raise ValueError(
                f"{source} gives {num_blocks} KV blocks ({num_blocks * cache.block_size} tokens), fewer than the "
                f"{need} one request of max_model_len={max_len} tokens holds; raise the KV cache memory or lower "
                "max_model_len"
            )
        return num_blocks

    def kv_cache_windows(self) -> list[int]:
        """The sliding window of each KV cache group (0: full attention), for the scheduler's KV cache manager."""
        return list(self.model_runner.kv_layout.windows)

    def initialize_cache(self, num_blocks: int) -> None:
        per_block = self.model_runner.kv_cache_bytes_per_block()
        layout = self.model_runner.kv_layout
        bs = self.config.cache_config.block_size
        if per_block == 0:
            logger.info("no KV cache: an encoder computes each prompt whole (%d blocks of accounting)", num_blocks)
        elif layout.hybrid:  # a block id is `slots` layers' block: its tokens depend on how requests' windows share it
            logger.info(
                "KV cache: %d blocks of %d tokens (%.2f GiB) in %d groups of %d layers, windows %s",
                num_blocks, bs, num_blocks * per_block / 2**30, layout.num_groups, layout.slots,
                sorted(set(layout.windows)),
            )  # fmt: skip
        else:
            logger.info(
                "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens)",
                num_blocks, bs, num_blocks * per_block / 2**30, num_blocks * bs,
            )  # fmt: skip
        start = time.perf_counter()
        self.model_runner.initialize_kv_cache(num_blocks)
        logger.info("startup: KV cache allocation %.2f s", time.perf_counter() - start)

    def describe(self) -> dict[str, object]:
        """What this rank runs: its attention backend, native ops, whether decode uses the fused decoder, and how
        its tensor-parallel sums travel ("shm", "gloo", or "none" on one rank)."""
        runner = self.model_runner
        tp = self.tp
        return {
            "rank": tp.rank,
            "attention_backend": runner.attn_backend.name,
            "fused_decoder": runner.decode_runner is not None,
            "all_reduce": "none" if tp.world_size == 1 else ("shm" if tp.shm is not None else "gloo"),
            "threads": torch.get_num_threads(),
        }

    def process_id(self) -> int:
        """The worker's process id (tests stop ranks by it)."""
        return os.getpid()

    def add_lora(self, lora_request: Any) -> bool:
        """Load a LoRA adapter (a LoRARequest, or its fields as a list, as it crosses a process boundary)."""
        from pagedllm.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            lora_request = LoRARequest(*lora_request)
        return self.model_runner.lora_manager_or_raise().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora_manager_or_raise().remove(int(lora_id))

    def list_loras(self) -> list[int]:
        return self.model_runner.lora_manager_or_raise().list()

    def set_num_threads(self, total: int) -> int:
        """Run on a share of `total` threads (the ranks of every engine on this machine split it as at start-up),
        never more than at start-up (the fused decoder's scratch is sized for those); returns this rank's count.
        The router lowers it while two models compute at once, so that their thread teams do not fight over cores."""
        ranks = self.config.parallel_config.world_size_across_dp
        torch.set_num_threads(max(1, min(total // ranks, self.max_threads)))
        return torch.get_num_threads()

    def sleep(self) -> None:
        """Level-1 sleep: the weights' and KV cache's memory back to the system (worker/sleep.py)."""
        self.model_runner.sleep()

    def wake_up(self) -> None:
        self.model_runner.wake_up()

    def shutdown(self) -> None:
        """Before the worker is dropped in this process (the in-process executor's shutdown)."""
        self.model_runner.shutdown()

    def set_poll_hook(self, hook: Callable[[], None] | None) -> None:
        """An encoder pooling model calls `hook` between (and within) the layers of each step (the engine core's
        express lane; in-process workers only)."""
        if self.model_runner.pooler is not None:
            self.model_runner.pooler.poll = hook

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(sched)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)
