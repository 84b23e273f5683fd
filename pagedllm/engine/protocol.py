"""Messages that cross the engine-core process boundary, as msgspec Structs (msgpack on the wire).

Nothing else crosses: no pickle, no tensors, no free-form dicts. The front end sends `EngineCoreRequest`s
(wrapped by request type) and receives `EngineCoreOutputs`, one per engine step that produced something.

Clocks: `EngineCoreRequest.arrival_time` is the front end's wall clock (`time.time()`). Every timestamp the core
stamps (`EngineCoreEvent.timestamp`, `EngineCoreOutputs.timestamp`) is the core process's `time.monotonic()`,
as in vLLM: the front end only subtracts core timestamps from each other (queue, prefill and decode times),
never from its own clock, so the two processes need not share a clock and a wall-clock step cannot make an
interval negative.

Fields are only ever added at the end of a Struct and with a default, so that messages keep their shape.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI/vLLM name."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3  # the engine could not serve the request (its grammar failed or timed out); stop_reason says why

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequestType(enum.Enum):
    """First frame of every front-end -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # A pooling request (its sampling_params then only a placeholder): the pooled output instead of tokens.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs with (--enable-lora; the engine has loaded it: EngineCore.add_lora).
    lora_request: LoRARequest | None = None
    # Mixed into its block hashes: it shares prefix-cache blocks only with requests of the same salt (vLLM's)
    cache_salt: str | None = None


class PooledData(msgspec.Struct, array_like=True, gc=False):
    """A pooling request's result: float32 values in C order (`bytes`, so that a vector crosses as one buffer) and
    their shape ([hidden], [num_labels], or [tokens, hidden] for per-token states)."""

    data: bytes
    shape: list[int]


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Call a public method of the engine core by name; answered by a UtilityOutput with the same call_id."""

    call_id: int
    method: str
    args: list[Any] = []


class HandshakeMessage(msgspec.Struct, omit_defaults=True, gc=False):
    """First message from a starting engine-core process: READY, or FAILED with the error."""

    status: str
    error: str | None = None
    num_blocks: int = 0
    pid: int = 0


class LogprobsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs for a run of positions: row i is position i.

    `token_ids[i]` is the sampled (or prompt) token followed by the top-N tokens; `logprobs[i]` their
    log-probabilities in the same order; `ranks[i]` the rank of the first token (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request inside the core (wire values: never renumber)."""

    QUEUED = 1  # the scheduler received the request
    SCHEDULED = 2  # the scheduler admitted it from the waiting queue (first time, and again after a preemption)
    PREEMPTED = 3  # its KV blocks were freed; it went back to the waiting queue to be recomputed


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped event of one request; `timestamp` is the core's `time.monotonic()`."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Events since the request's previous output, oldest first (None when there were none).
    events: list[EngineCoreEvent] | None = None
    pooling_output: PooledData | None = None  # a pooling request's result (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding since the last report: verifications of drafts, their tokens, the tokens accepted, and
    `num_accepted_tokens_per_pos[i]`: how many verifications accepted draft position i (vLLM's names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Scheduler state after a step, for metrics and the stats line."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None  # None without speculative decoding
    # --enable-lora: requests by adapter name, running and waiting (None without adapters served)
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All outputs of one engine step (or the answer to a utility call)."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # the core's time.monotonic() when the step's outputs were made; 0.0 for utility answers
    utility_output: UtilityOutput | None = None
    engine_index: int = 0  # which data-parallel engine core sent these (stamped by core_proc)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The result of a UTILITY call: `call_id` echoes the request, `result` is plain msgpack data."""

    call_id: int
    failure_message: str | None = None
    result: Any = None


# ---- executor <-> worker processes (executor/multiproc.py, worker/worker_proc.py) ----------------------------------


class WorkerRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One call broadcast to every worker: `method` of the Worker with `args` (msgpack of the method's arguments:
    a SchedulerOutput for execute_model, a list of plain values otherwise). `reply`: "all" ranks answer, or only
    "driver" (rank 0), or "none"."""

    call_id: int
    method: str
    args: bytes = b""
    reply: str = "all"


class WorkerResponse(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A worker's answer to a WorkerRequest (call_id -1: its start-up report). `result` is msgpack of the method's
    return value; `error` the exception's type and message when it raised."""

    call_id: int
    rank: int
    result: bytes = b""
    error: str | None = None
