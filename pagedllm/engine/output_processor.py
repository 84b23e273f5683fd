"""OutputProcessor: EngineCoreOutputs -> RequestOutputs, in the front-end process.

The one loop over a step's outputs: detokenize incrementally, find stop strings (a request they finish must
then be aborted in the core: returned in `reqs_to_abort`), convert logprobs, stamp times, and build
RequestOutputs as each request asked (cumulative, delta or final only). A request with n > 1 is fanned out
into n child requests in the core; `ParentRequest` gathers their completions back into one output.

Stats (`IterationStats`, for pagedllm/metrics.py), with vLLM's definitions. Two clocks, never mixed in one
interval: TTFT, inter-token latency and E2E latency are front-end wall clock (`time.time()` when outputs are
processed, minus the front-end `arrival_time`); queue, prefill and decode times are differences of the engine
core's `time.monotonic()` stamps (its events and `EngineCoreOutputs.timestamp`):
  queue time   = first SCHEDULED - QUEUED (the scheduler received it; tokenization and transport not included)
  prefill time = first token's step - first SCHEDULED (a preempted and rescheduled request keeps its first)
  decode time  = last token's step - first token's step
so queue + prefill <= TTFT up to the transport of the first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """Gathers the completions of the n children of one user request."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.outputs: dict[int, CompletionOutput] = {}
        self.num_finished = 0

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def update(self, completion: CompletionOutput, kind: RequestOutputKind) -> tuple[list[CompletionOutput], bool]:
        """Record one child's completion; returns (completions to report now, all children finished)."""
        self.outputs[completion.index] = completion
        if completion.finish_reason is not None:
            self.num_finished += 1
        done = self.num_finished == self.params.n
        if kind == RequestOutputKind.DELTA:
            return [completion], done
        if kind == RequestOutputKind.FINAL_ONLY and not done:
            return [], False
        return [self.outputs[i] for i in sorted(self.outputs)], done


def fan_out(req: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """Split a request with n > 1 into n single-sample children (ids "i_<id>", seed + i when seeded).
    They share the prompt's KV blocks through the prefix cache."""
    params = req.sampling_params
    if params.n == 1:
        return None, [req]
    parent = ParentRequest(req.request_id, params)
    children = []
    for index in range(params.n):
        child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + index)
        children.append(msgspec.structs.replace(req, request_id=parent.child_id(index), sampling_params=child_params))
    return parent, children


@dataclass
class RequestState:
    request_id: str  # the id inside the engine core
    external_id: str  # the id the caller knows (the parent's for n > 1)
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    parent: ParentRequest | None = None
    queue: Any = None  # async consumers put their per-request collector here
    eos_token_id: int | None = None  # the request's eos (None: the model has none)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Engine-core monotonic timestamps (comparable with each other only), None until seen.
    queued_ts: float | None = None
    scheduled_ts: float | None = None  # the first SCHEDULED
    core_first_token_ts: float | None = None
    core_last_token_ts: float | None = None
    pooling: bool = False  # a pooling request: one output, its pooled result (no detokenizer)
    stream_interval: int = 1  # an output is made once this many tokens wait (and for the first and the last)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def update_from_events(self, events: list[EngineCoreEvent]) -> None:
        """Keep the first QUEUED and the first SCHEDULED (a preempted request is scheduled again later)."""
        for event in events:
            if event.type == EngineCoreEventType.QUEUED and self.queued_ts is None:
                self.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and self.scheduled_ts is None:
                self.scheduled_ts = event.timestamp


def _stop_terminated(
    state: RequestState, finish: FinishReason | None, new_ids: list[int], stop_reason: int | str | None
) -> bool:
    """Whether the last new token ended the request as an eos or stop token (its text is then not output). A
    request whose grammar completed (structured output) also finishes with "stop", on an ordinary token."""
    if finish != FinishReason.STOP or not new_ids:
        return False
    if isinstance(stop_reason, int):
        return new_ids[-1] == stop_reason
    return new_ids[-1] == state.eos_token_id


def _interval(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(end - start, 0.0)


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished request; times in seconds (see the module docstring for the clocks)."""

    request_id: str  # the engine-core id (a child's for n > 1)
    finish_reason: str
    e2e_latency: float  # front-end arrival -> finish
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None  # QUEUED -> first SCHEDULED; None when the core sent no events
    prefill_time: float | None  # first SCHEDULED -> first token
    decode_time: float | None  # first token -> last token


@dataclass(slots=True)
class IterationStats:
    """What the front end observed while processing outputs (feeds metrics; see pagedllm/metrics.py)."""

    num_prompt_tokens: int = 0  # prompts of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def update_from_output(
        self, state: RequestState, out: EngineCoreOutput, now: float, engine_core_timestamp: float | None
    ) -> None:
        """Stamp `state` with one output's events and token times (`now`: front-end wall clock)."""
        if out.events:
            state.update_from_events(out.events)
        if not out.new_token_ids:
            return
        if engine_core_timestamp is not None:
            if state.core_first_token_ts is None:
                state.core_first_token_ts = engine_core_timestamp
            state.core_last_token_ts = engine_core_timestamp
        self.num_generation_tokens += len(out.new_token_ids)
        if state.first_token_time is None:
            state.first_token_time = now
            self.num_prompt_tokens += len(state.prompt_token_ids)
            self.time_to_first_tokens.append(now - state.arrival_time)
        elif state.last_token_time is not None:
            self.inter_token_latencies.append(now - state.last_token_time)
        state.last_token_time = now

    def update_from_finished(self, state: RequestState, now: float) -> None:
        self.finished.append(
            FinishedRequestStats(
                request_id=state.request_id,
                finish_reason=str(state.finish_reason),
                e2e_latency=now - state.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.token_ids),
                queue_time=_interval(state.queued_ts, state.scheduled_ts),
                prefill_time=_interval(state.scheduled_ts, state.core_first_token_ts),
                decode_time=_interval(state.core_first_token_ts, state.core_last_token_ts),
            )
        )

    def merge(self, other: IterationStats) -> None:
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_generation_tokens += other.num_generation_tokens
        self.time_to_first_tokens.extend(other.time_to_first_tokens)
        self.inter_token_latencies.extend(other.inter_token_latencies)
        self.finished.extend(other.finished)


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.stream_interval = stream_interval  # --stream-interval: tokens a streamed chunk gathers

    def add_engine_request(
        self, prompt: str | None, req: EngineCoreRequest, queue: Any = None
    ) -> list[EngineCoreRequest]:
        """Register a request (fanned out when n > 1); returns the engine-core requests to send."""
        parent, children = fan_out(req)
        for index, child in enumerate(children):
            self.add_request(
                child.request_id,
                prompt,
                child.prompt_token_ids,
                child.sampling_params,
                child.arrival_time,
                parent,
                index,
                queue,
                child.eos_token_id,
                pooling=child.pooling_params is not None,
            )
        return children

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
        eos_token_id: int | None = None,
        pooling: bool = False,
    ) -> None:
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        detokenizer = None if pooling else IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self.request_states[request_id] = RequestState(
            request_id=request_id,
            external_id=parent.request_id if parent else request_id,
            index=index,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detokenizer,  # type: ignore[arg-type]
            arrival_time=arrival_time,
            parent=parent,
            queue=queue,
            eos_token_id=eos_token_id,
            pooling=pooling,
            stream_interval=max(self.stream_interval, params.stream_interval or 1),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (aborted by the caller); returns the engine-core ids to abort."""
        removed = []
        for rid in request_ids:
            if self.request_states.pop(rid, None) is not None:
                removed.append(rid)
        return removed

    def process_outputs(
        self, outputs: list[EngineCoreOutput], engine_core_timestamp: float | None = None
    ) -> OutputProcessorOutput:
        """Process one step's outputs; `engine_core_timestamp` is that step's `EngineCoreOutputs.timestamp`
        (core monotonic clock; without it prefill and decode times are not measured)."""
        now = time.time()
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        stats = IterationStats()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted by the caller while the step ran
            if state.pooling:
                ro = self._pooling_output(state, out, now, engine_core_timestamp, stats)
                if ro is not None and state.queue is not None:
                    state.queue.put(ro)
                elif ro is not None:
                    request_outputs.append(ro)
                continue
            stats.update_from_output(state, out, now, engine_core_timestamp)
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
            new_ids = list(out.new_token_ids)
            finish = out.finish_reason
            stop_reason = out.stop_reason
            terminated = _stop_terminated(state, finish, new_ids, stop_reason)
            if len(new_ids) > 1:
                # Several tokens in one step (accepted drafts): a token that completes a stop string ends the
                # output there, as it would have one token at a time.
                for k, tid in enumerate(new_ids):
                    stop_str = state.detokenizer.update([tid], terminated and k == len(new_ids) - 1)
                    if stop_str is not None:
                        new_ids = new_ids[: k + 1]
                        break
            else:
                stop_str = state.detokenizer.update(new_ids, terminated)
            if stop_str is not None and finish is None:
                finish, stop_reason = FinishReason.STOP, stop_str
                to_abort.append(out.request_id)
            elif stop_str is not None:
                finish, stop_reason = FinishReason.STOP, stop_str
            state.token_ids.extend(new_ids)
            if out.new_logprobs is not None and state.logprobs is not None:
                dicts = self._logprob_dicts(out.new_logprobs)[: len(new_ids)]
                state.logprobs.extend(dicts)
                for tok, d in zip(new_ids, dicts):
                    state.cumulative_logprob += d[tok].logprob  # type: ignore[operator]
            if finish is not None:
                state.finish_reason = str(finish)
                state.stop_reason = stop_reason
                self.request_states.pop(out.request_id, None)
                stats.update_from_finished(state, now)
            ro = self._make_output(state, now)
            if ro is not None:
                if state.queue is not None:
                    state.queue.put(ro)
                else:
                    request_outputs.append(ro)
        return OutputProcessorOutput(request_outputs, to_abort, stats)

    def _pooling_output(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        now: float,
        engine_core_timestamp: float | None,
        stats: IterationStats,
    ) -> PoolingRequestOutput | None:
        """A pooling request's one output: its result as a float32 tensor (empty if it finished without one, e.g.
        aborted); its prompt tokens and finish counted in the stats as a prefill's."""
        import numpy as np
        import torch

        if out.events:
            state.update_from_events(out.events)
        if out.finish_reason is None:
            return None
        state.core_first_token_ts = state.core_last_token_ts = engine_core_timestamp
        state.first_token_time = state.last_token_time = now
        state.num_cached_tokens = out.num_cached_tokens
        state.finish_reason = str(out.finish_reason)
        state.stop_reason = out.stop_reason
        self.request_states.pop(out.request_id, None)
        stats.num_prompt_tokens += len(state.prompt_token_ids)
        stats.update_from_finished(state, now)
        pooled = out.pooling_output
        if pooled is None:
            data = torch.empty(0)
        else:
            data = torch.from_numpy(np.frombuffer(pooled.data, dtype=np.float32).copy()).view(pooled.shape)
        return PoolingRequestOutput(
            request_id=state.external_id,
            outputs=PoolingOutput(data),
            prompt_token_ids=state.prompt_token_ids,
            num_cached_tokens=state.num_cached_tokens,
            finished=True,
            prompt=state.prompt,
        )

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        result = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            d: dict[int, Logprob] = {}
            for j, (tid, lp) in enumerate(zip(ids, lps)):
                if tid in d:
                    continue  # the chosen token may also appear among the top-N
                d[tid] = Logprob(lp, rank if j == 0 else j, self.tokenizer.decode([tid]))
            result.append(d)
        return result

    def _make_output(self, state: RequestState, now: float) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if (
            not finished
            and state.stream_interval > 1
            and state.sent_tokens > 0
            and len(state.token_ids) - state.sent_tokens < state.stream_interval
        ):
            return None  # gathering tokens for the next chunk
        delta = kind == RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = state.token_ids[state.sent_tokens :]
            logprobs = state.logprobs[state.sent_logprobs :] if state.logprobs is not None else None
            if not token_ids and not text and not finished:
                return None
        else:
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        state.sent_tokens = len(state.token_ids)
        state.sent_logprobs = len(state.logprobs or [])
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        completions = [completion]
        all_done = finished
        if state.parent is not None:
            completions, all_done = state.parent.update(completion, kind)
            if not completions:
                return None
        prompt_lp = state.prompt_logprobs
        metrics = RequestMetrics(
            arrival_time=state.arrival_time,
            first_token_time=state.first_token_time,
            last_token_time=state.last_token_time,
            finished_time=now if finished else None,
        )
        return RequestOutput(
            request_id=state.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_lp,
            outputs=completions,
            finished=all_done,
            metrics=metrics,
            num_cached_tokens=state.num_cached_tokens,
        )
