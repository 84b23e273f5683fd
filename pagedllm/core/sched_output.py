"""SchedulerOutput: the plan of one step, from the scheduler to the worker.

A request is sent in full once (`NewRequestData`), the first time it is scheduled; afterwards only diffs
travel (`CachedRequestData`): new block ids and the computed-token count. A request resumed after
preemption lost its blocks, so its block list is replaced rather than extended. Block ids come one list per KV
cache group (core/kv_cache_layout.py); a window group's list holds the null block where its window dropped one.
The worker keeps the token ids it needs itself (it appends what it samples), so the scheduler never resends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.protocol import LogprobsLists, PooledData
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[list[int]]  # [num_kv_groups][blocks]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request (verified: task and defaults set)
    lora_request: LoRARequest | None = None  # its adapter (--enable-lora)


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)  # [num_cached] replace blocks if True
    # [num_cached][num_kv_groups] blocks appended this step to each KV cache group's list (all of them when resumed)
    new_block_ids: list[list[list[int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # [num_cached]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Requests that left the running set since the last step (finished, aborted or preempted): the worker
    # drops them from its batch; finished ones also from its state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that sample under a grammar this step, in the order of the grammar bitmask's rows: when there are
    # any, execute_model returns None and sample_tokens(grammar_output) samples.
    structured_output_request_ids: list[str] = field(default_factory=list)
    # Speculative decoding: the draft tokens scheduled for verification (after the request's last token, counted in
    # its num_scheduled_tokens), and how many draft tokens each request should propose after this step's sample.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens_to_propose: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the worker returns for a step; rows are in `req_ids` order."""

    req_ids: list[str]
    # [num_reqs][0 or more]: empty for a request still in its prompt; with drafts, the accepted ones and one more
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # req_id -> of the sampled tokens
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # req_id -> for a chunk of the prompt
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # req_id -> draft tokens proposed for it
    # req_id -> the pooled result of a pooling request whose prompt was completed this step
    pooler_output: dict[str, PooledData] = field(default_factory=dict)
