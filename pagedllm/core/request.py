"""Request: the scheduler's mutable view of one sequence, and its state machine.

A request is `num_computed_tokens` catching up with `num_tokens`. There is no prefill or decode phase: a
chunked prompt, a prefix-cache hit and a recompute after preemption are only different token counts.
Statuses are ordered so that `is_finished` is `status > PREEMPTED`.
The scheduler records `EngineCoreEvent`s (queued, scheduled, preempted; core `time.monotonic()`) on the
request; they leave with its next `EngineCoreOutput` (`take_events`).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagedllm.engine.protocol import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING_FOR_FSM = enum.auto()  # its grammar is compiling (structured output): not in the waiting queue yet
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is terminal.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One sequence inside the engine core. Mutated only by the scheduler and the KV cache manager."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: int = 16,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        # A pooling request: it finishes when its prompt is computed, with the pooled result instead of a token.
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        self.lora_id = 0 if lora_request is None else lora_request.lora_int_id
        # Resolved by the scheduler from max_model_len when the user left it open.
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache the first time the request was scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of this request's full blocks, in order; extended by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Mixed into every block hash (with a LoRA adapter id): prefix-cache hits only among the same salt.
        self.cache_salt: str | None = None
        # Events not yet sent to the front end (see take_events).
        self.events: list[EngineCoreEvent] = []
        # Its grammar, when it asked for structured output (set by the StructuredOutputManager).
        self.structured_output: StructuredOutputRequest | None = None
        # Draft tokens the worker proposed after its last sample (speculative decoding), verified next step.
        self.spec_token_ids: list[int] = []
        # Whether those are tokens its grammar forces (the scheduler's, not the proposer's: kept out of its stats).
        self.drafts_forced = False

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_tokens: int) -> Request:
        request = cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            max_tokens=max_tokens,
            pooling_params=req.pooling_params,
            lora_request=req.lora_request,
        )
        request.cache_salt = req.cache_salt
        return request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Stamp an event with the core's monotonic clock (or `timestamp`, from the same clock)."""
        self.events.append(EngineCoreEvent(event_type, time.monotonic() if timestamp is None else timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events recorded since the last call (None if there were none), for the next output."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def get_finish_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
