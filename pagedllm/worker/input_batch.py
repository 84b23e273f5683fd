"""InputBatch: the worker's persistent per-request state, updated from SchedulerOutput diffs.

Each request the worker knows keeps a `CachedRequestState` (its tokens, sampling settings, generator) until
it finishes. Requests in the running set also own a row of the CPU-side arrays (token ids, block table),
written once when the request arrives and then only extended: the block table gains the step's new block
ids, the token row gains each sampled token. A preempted request gives up its row but keeps its state, so
its seeded generator continues where it stopped when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt positions whose logprobs were already reported (a recompute after preemption repeats none).
    num_prompt_logprobs_done: int = 0
    row: int = -1  # row in the batch arrays, -1 while not running

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)  # [rows, max_model_len]
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)  # [rows, max_blocks]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # [rows]
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Apply one step's diff: drop finished, release preempted rows, add new, extend the rest."""
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._release_row(state)
        for req_id in sched.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                self._release_row(state)
        for new in sched.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
            state = CachedRequestState(new.req_id, new.prompt_token_ids, params, new.eos_token_id, gen)
            self.requests[new.req_id] = state
            self._take_row(state, new.block_ids)
            state.num_computed_tokens = new.num_computed_tokens
        c = sched.scheduled_cached_reqs
        for req_id, resumed, block_ids, computed in zip(
            c.req_ids, c.resumed_from_preemption, c.new_block_ids, c.num_computed_tokens
        ):
            state = self.requests[req_id]
            if resumed:
                self._take_row(state, block_ids)
            else:
                self._append_blocks(state, block_ids)
            state.num_computed_tokens = computed

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        pos = state.num_tokens
        state.output_token_ids.append(token_id)
        if pos < self.max_model_len:
            self.token_ids[state.row, pos] = token_id

    def _take_row(self, state: CachedRequestState, block_ids: list[int]) -> None:
        if state.row < 0:
            state.row = self.free_rows.pop()
        row = state.row
        prompt = state.prompt_token_ids
        self.token_ids[row, : len(prompt)] = prompt
        if state.output_token_ids:
            self.token_ids[row, len(prompt) : state.num_tokens] = state.output_token_ids
        state.block_ids = list(block_ids)
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def _append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = state.row
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
        state.block_ids.extend(block_ids)

    def _release_row(self, state: CachedRequestState) -> None:
        if state.row >= 0:
            self.free_rows.append(state.row)
            state.row = -1
