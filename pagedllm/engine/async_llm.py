"""AsyncLLM: the online front door. `generate()` is an async iterator of RequestOutputs.

One output-handler task pulls EngineCoreOutputs from the engine-core process, runs the OutputProcessor over
them in chunks (yielding to the event loop between chunks so HTTP handlers stay responsive) and fills one
`RequestOutputCollector` per request. A slow consumer does not block anyone: the collector merges deltas
(or keeps the newest cumulative output) until it is read. Stop strings found here abort the request in
the core. If the core dies, every waiting consumer gets `EngineDeadError`. With `log_requests` (the server's
--enable-log-requests) each request is logged at INFO when it is added: id, prompt, sampling params.

Stats: every step's SchedulerStats and the front end's IterationStats go to each of `stat_loggers`, with the index
of the data-parallel engine that ran the step (`record(scheduler_stats, iteration_stats, engine_idx=i)`). When
aborts leave an engine with no request, its last step's stats still count the aborted requests (they ran in it),
and no further step will correct them: that engine's scheduler stats are then asked for once more (a utility
call, answered after it processed the aborts), so that its gauges read 0 when it is idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import AsyncMPClient, merge_invariants
from pagedllm.engine.core_process import CoreProcess
from pagedllm.engine.exceptions import EngineDeadError, EngineSleepingError
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm import check_sleep_level, log_startup_notes, start_front_end
from pagedllm.engine.output_processor import IterationStats
from pagedllm.engine.protocol import SchedulerStats
from pagedllm.lora.request import LoRARegistry, LoRARequest, lora_errors
from pagedllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.reasoning import ReasoningParser, default_reasoning_parser
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

OUTPUT_CHUNK_SIZE = 128
SLEEP_DRAIN_POLL_S = 0.01  # how often sleep() looks whether the requests in flight have finished


class RequestOutputCollector:
    """Holds the outputs of one request until its consumer reads them; merges deltas meanwhile."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(item, BaseException) or isinstance(self.output, BaseException):
            self.output = item
        elif self.kind == RequestOutputKind.DELTA:
            _merge_delta(self.output, item)
        else:
            self.output = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        item, self.output = self.output, None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[return-value]


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class AsyncLLM:
    def __init__(
        self,
        engine_args: EngineArgs,
        core: CoreProcess | None = None,
        log_requests: bool = False,
        max_log_len: int | None = None,
        sleep_auto_wake: bool = False,
    ) -> None:
        """`core`: the engine-core process, if already started from `engine_args.for_engine_core()` (as
        `pagedllm serve` does, before its imports); else it is started here. It is stopped if this fails.
        `log_requests` (--enable-log-requests): log each request as it is added, its prompt text and token ids cut
        to `max_log_len` (--max-log-len; None: whole). `sleep_auto_wake` (--sleep-auto-wake): a request that arrives
        while the engine sleeps wakes it, rather than failing with EngineSleepingError."""
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        # The core process builds its config from the same arguments (with the KV budget fixed in them).
        self.engine_args = engine_args.for_engine_core()
        # The front end needs only the model's config (tokenizer, limits, name): no torch is imported for it.
        try:
            mc = self.engine_args.create_model_config()
        except BaseException:
            if core is not None:
                core.close()
            raise
        self.model_config = mc
        log_startup_notes(self.engine_args, mc)
        # The core process starts first: it loads the model while this process loads the tokenizer.
        self.engine_core = AsyncMPClient(self.engine_args, connect=False, core=core)
        name = self.engine_args.reasoning_parser
        self.tokenizer, self.input_processor, self.output_processor = start_front_end(
            mc, self.engine_core, name, self.engine_args.enable_lora, self.engine_args.stream_interval
        )
        self.loras = LoRARegistry()  # the adapters the engines hold (--enable-lora)
        # The split of thinking from content (the server's reasoning_content), when the model thinks.
        # (gpt-oss: its harmony channels by default; the engine core needs no parser for them, see reasoning/)
        name = name or default_reasoning_parser(getattr(mc.hf_config, "model_type", None), self.tokenizer)
        self.reasoning_parser = ReasoningParser.for_tokenizer(name, self.tokenizer) if name else None
        self._handler: asyncio.Task | None = None
        self.errored: BaseException | None = None
        self.stat_loggers: list[Any] = []
        self._stats_tasks: set[asyncio.Task] = set()
        self.sleep_auto_wake = sleep_auto_wake
        self.sleep_level = 0  # as the front end last set it (sleep()); requests check it before entering
        self._sleep_lock: asyncio.Lock | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args)

    @property
    def is_running(self) -> bool:
        return self.errored is None and not self.engine_core.dead

    @property
    def dead(self) -> bool:
        return self.engine_core.dead or isinstance(self.errored, EngineDeadError)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests ---------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate, register and send a request (a pooling one with PoolingParams; `lora_request`: its adapter,
        loaded first if the engines do not hold it); returns the collector its outputs go to."""
        if self.errored is not None:
            raise (self.errored if isinstance(self.errored, EngineDeadError) else EngineDeadError(str(self.errored)))
        if self.sleep_level:
            if not self.sleep_auto_wake:
                raise EngineSleepingError(
                    f"the model is asleep (level {self.sleep_level}): wake it up first (POST /wake_up)"
                )
            await self.wake_up()
        text, req = self.input_processor.process(
            request_id, prompt, params, time.time(), priority, add_special_tokens, lora_request
        )
        if self.log_requests:
            self._log_request(request_id, text, req.prompt_token_ids, params, lora_request)
        if lora_request is not None:
            await self.add_lora(lora_request)
        self._ensure_handler()
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        collector = RequestOutputCollector(kind)
        children = self.output_processor.add_engine_request(text, req, queue=collector)
        try:
            engine = None  # the n children of a request share an engine (and its prefix cache)
            for child in children:
                engine = await self.engine_core.add_request_async(child, engine)
        except BaseException:
            # Nothing of a request that did not fully reach the core may stay registered here or there.
            ids = [child.request_id for child in children]
            self.output_processor.abort_requests(ids)
            self.engine_core.abort_requests_nowait(ids)
            raise
        return collector

    def _log_request(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None,
    ) -> None:
        """vLLM's "Received request" line (its RequestLogger), the prompt and its ids cut to --max-log-len."""
        n = self.max_log_len
        if n is not None:
            text = None if text is None else text[:n]
            ids = ids[:n]
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
            request_id, text, params, ids, lora_request,
        )  # fmt: skip

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs as they come; leaving early (or being cancelled) aborts it."""
        collector = await self.add_request(
            request_id, prompt, sampling_params, priority, add_special_tokens, lora_request
        )
        finished = False
        try:
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                # No await here: a cancelled caller (a client that went away) could lose an awaited send.
                self.abort_nowait(request_id)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (its task in `pooling_params`): yields its one PoolingRequestOutput; leaving early (or
        being cancelled) aborts it."""
        collector = await self.add_request(request_id, prompt, pooling_params, priority, add_special_tokens)
        finished = False
        try:
            out: Any = collector.get_nowait() or await collector.get()
            finished = True
            yield out
        finally:
            if not finished:
                self.abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request (all n children); its KV blocks are freed in the core."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Forget the request here and send the abort to the core without waiting."""
        ids = [
            rid
            for rid, st in self.output_processor.request_states.items()
            if rid == request_id or st.external_id == request_id
        ]
        removed = self.output_processor.abort_requests(ids)
        if removed:
            engines = self.engine_core.router.engines_of(removed)
            self.engine_core.abort_requests_nowait(removed)
            self._refresh_stats_if_idle(engines)

    # ---- the output handler -------------------------------------------------------------------------

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_handler(), name="output-handler")

    async def _output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                items = outputs.outputs
                core_ts = outputs.timestamp or None  # the core's monotonic clock; 0.0 means not stamped
                stats = IterationStats()
                aborted: set[int] = set()
                for start in range(0, len(items), OUTPUT_CHUNK_SIZE):
                    if start:
                        await asyncio.sleep(0)
                    chunk = items[start : start + OUTPUT_CHUNK_SIZE]
                    processed = self.output_processor.process_outputs(chunk, core_ts)
                    stats.merge(processed.stats)
                    if processed.reqs_to_abort:
                        aborted |= self.engine_core.router.engines_of(processed.reqs_to_abort)
                        await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                self._record_stats(outputs.scheduler_stats, stats, outputs.engine_index)
                if aborted:
                    self._refresh_stats_if_idle(aborted)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.errored = e if isinstance(e, EngineDeadError) else EngineDeadError(f"output handler failed: {e}")
            if not isinstance(e, EngineDeadError):
                logger.exception("output handler failed")
            for state in list(self.output_processor.request_states.values()):
                if state.queue is not None:
                    state.queue.put(self.errored)
            self.output_processor.request_states.clear()

    def _record_stats(self, scheduler_stats: Any, stats: IterationStats, engine_idx: int = 0) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, stats, engine_idx=engine_idx)
            except Exception:  # metrics must never take the engine down
                logger.exception("stat logger %r failed", stat_logger)

    def _refresh_stats_if_idle(self, engines: set[int]) -> None:
        """After aborts (sent before this call) left some of `engines` with no request, record fresh scheduler stats
        of those."""
        if not self.stat_loggers or self.errored is not None:
            return
        idle = sorted(i for i in engines if self.engine_core.router.load[i] == 0)
        if not idle:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the event loop: no stat logger is fed from there either
            return
        # Its answer comes after the outputs of the core's last step with the aborted requests, which the output
        # handler records first (it is woken first, and records a step's stats without awaiting in between).
        task = loop.create_task(self._refresh_stats(idle), name="stats-refresh")
        self._stats_tasks.add(task)
        task.add_done_callback(self._stats_tasks.discard)

    async def _refresh_stats(self, engines: list[int]) -> None:
        try:
            calls = [self.engine_core.call_utility_async("get_scheduler_stats", engine=i) for i in engines]
            results = await asyncio.gather(*calls)
        except Exception:  # a dead engine is reported by the output handler; stats are best effort
            return
        for engine_idx, result in zip(engines, results):
            self._record_stats(msgspec.convert(result, SchedulerStats), IterationStats(), engine_idx)

    # ---- utilities ----------------------------------------------------------------------------------

    @property
    def num_engines(self) -> int:
        """Data-parallel engine cores behind this front end."""
        return self.engine_core.num_engines

    async def check_invariants(self) -> dict[str, Any]:
        """Every engine's block-pool check; their counts summed (each engine's under "engines" when several)."""
        return merge_invariants(await self.engine_core.call_utility_all_async("check_invariants"))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter in every engine (False when they hold it); ValueError naming what is wrong with it."""
        self.input_processor.verify_lora(lora_request)
        if not self.loras.needs_loading(lora_request):
            return False
        with lora_errors():
            await self.engine_core.call_utility_all_async("add_lora", lora_request)
        self.loras.added(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter `lora_id` (requests using it finish first); False when it was not loaded."""
        if self.loras.removed(lora_id) is None:
            return False
        return any(await self.engine_core.call_utility_all_async("remove_lora", lora_id))

    # ---- sleep mode ---------------------------------------------------------------------------------

    @property
    def sleeping(self) -> bool:
        """Whether the engine sleeps, or is being put to sleep (new requests are refused or wait for wake_up)."""
        return self.sleep_level > 0

    def _lock(self) -> asyncio.Lock:
        if self._sleep_lock is None:  # made on the running loop (the constructor may run on another thread)
            self._sleep_lock = asyncio.Lock()
        return self._sleep_lock

    async def sleep(self, level: int = 1) -> None:
        """Put the engines to sleep (engine/core.py `sleep`): from now on requests are refused (or wake it, with
        sleep_auto_wake); those in flight finish first."""
        check_sleep_level(level)
        async with self._lock():
            if level <= self.sleep_level:
                return
            self.sleep_level = level
            try:
                while self.output_processor.has_unfinished_requests():
                    await asyncio.sleep(SLEEP_DRAIN_POLL_S)
                await self.engine_core.call_utility_all_async("sleep", level)
            except BaseException:
                # Requests are accepted again; a core that went to sleep after all wakes at its next request.
                self.sleep_level = 0
                raise

    async def wake_up(self) -> None:
        """Wake the engines; requests are accepted again once they are up."""
        async with self._lock():
            if self.sleep_level:
                await self.engine_core.call_utility_all_async("wake_up")
                self.sleep_level = 0

    async def set_num_threads(self, total: int) -> None:
        """The engines' workers on a share of `total` threads (engine/core.py `set_num_threads`)."""
        await self.engine_core.call_utility_all_async("set_num_threads", total)

    async def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    async def reset_prefix_cache(self) -> bool:
        return all(await self.engine_core.call_utility_all_async("reset_prefix_cache"))

    def get_num_unfinished_requests(self) -> int:
        return len({st.external_id for st in self.output_processor.request_states.values()})

    def shutdown(self) -> None:
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        for task in list(self._stats_tasks):
            task.cancel()
        self.engine_core.shutdown()


__all__ = ["AsyncLLM", "RequestOutputCollector", "CompletionOutput"]
