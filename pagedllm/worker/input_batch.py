"""InputBatch: the worker's persistent per-request state, updated from SchedulerOutput diffs.

Each request the worker knows keeps a `CachedRequestState` (its tokens and sampling settings) until
it finishes. Requests in the running set also own a row of the CPU-side arrays, written once when the
request takes the row (new, or resumed after preemption) and then only extended:
- token ids and block tables (one per KV cache group, core/kv_cache_layout.py): each table gains the step's new
  block ids of its group, the token row each sampled token
  (and, for the step that verifies them, the draft tokens after the known ones);
- sampling state (temperature, top-k/top-p/min-p, penalties, logprobs, seed, logit bias,
  min_tokens, a reference to the output-token history that penalties read): filled from the request's
  `SamplingParams` when it takes the row, so a step only slices it.
A preempted request gives up its row but keeps its state, so its output history (and with it a seeded request's
draw index) continues where it stopped and its prompt logprobs are not reported twice when it recomputes its prompt.

`sampling_metadata(rows, vocab_size[, draft_pos])` is the one call the model runner makes per step: the
`SamplingMetadata` of the given rows, in that order, built by indexing the row arrays (no Python work per field and
request; the only per-row Python is gathering list references and the rows that use a seed, logit bias or
min_tokens). It equals what `SamplingMetadata.from_requests` builds from the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt positions whose logprobs were already reported (a recompute after preemption repeats none).
    num_prompt_logprobs_done: int = 0
    row: int = -1  # row in the batch arrays, -1 while not running
    pooling_params: Any = None  # a pooling request's PoolingParams (verified)
    pooled: Any = None  # its pooling so far, across prompt chunks (worker/pooler_runner.py)
    lora_request: Any = None  # its LoRA adapter (lora/request.py), None for the base model
    lora_id: int = 0  # the adapter's id (0: none)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device, num_groups: int = 1
    ) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)  # [rows, max_model_len]
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # [rows]
        self.block_table = np.zeros((num_groups, max_num_reqs, max_blocks), dtype=np.int64)  # [groups, rows, blocks]
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int64)  # [groups, rows]
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

        # Sampling state per row. Greedy rows hold temperature 0 and neutral filters, as SamplingMetadata wants.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)  # [rows] 0.0 = greedy
        self.top_k = np.full(max_num_reqs, -1, dtype=np.int64)  # [rows] -1 = no top-k (vocab-free)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)  # [rows]
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)  # [rows]
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)  # [rows]
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)  # [rows]
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)  # [rows]
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)  # [rows]
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # [rows] -1 = no logprobs
        # True for a greedy row with no penalty, logit bias, min_tokens or logprobs: a batch of these is a plain
        # argmax (the fast path of sampling_metadata).
        self.plain = np.ones(max_num_reqs, dtype=bool)  # [rows]
        # Per-row Python objects; the dicts hold only the rows that use the feature.
        self.output_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]  # the request's own list
        self.logit_bias: dict[int, dict[int, float]] = {}  # rows with a logit bias
        self.allowed_token_ids: dict[int, list[int]] = {}  # rows with allowed_token_ids
        self.bad_words: dict[int, list[list[int]]] = {}  # rows with bad words: their token sequences
        self.seeds: dict[int, int] = {}  # random rows with a seed: the seed
        # Rows still below min_tokens: (min_tokens, ids forbidden until then); dropped once reached.
        self.min_tokens: dict[int, tuple[int, set[int]]] = {}

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
            state = CachedRequestState(
                new.req_id,
                new.prompt_token_ids,
                new.sampling_params,
                new.eos_token_id,
                pooling_params=new.pooling_params,
                lora_request=new.lora_request,
                lora_id=0 if new.lora_request is None else new.lora_request.lora_int_id,
            )
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
        # Draft tokens go after the request's known tokens, where the step reads its input ids; they are
        # overwritten as tokens are accepted or sampled.
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            state = self.requests[req_id]
            pos = state.num_tokens
            self.token_ids[state.row, pos : pos + len(drafts)] = drafts

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        pos = state.num_tokens
        state.output_token_ids.append(token_id)  # also the row's penalty history: the same list
        if pos < self.max_model_len:
            self.token_ids[state.row, pos] = token_id
        entry = self.min_tokens.get(state.row)
        if entry is not None and len(state.output_token_ids) >= entry[0]:
            del self.min_tokens[state.row]
            self._refresh_plain(state.row, state.sampling_params)

    def sampling_metadata(
        self, rows: np.ndarray, vocab_size: int, draft_pos: np.ndarray | None = None
    ) -> SamplingMetadata:
        """The SamplingMetadata of `rows` [num_reqs] (rows of running requests), row i of it being rows[i]. With
        `draft_pos` (a step verifying drafts: row i is position draft_pos[i] of its request's rows, 0 at its last
        known token, j after its j-th draft), a seeded row's draw index is the request's output length plus it:
        the output position of the token that row samples."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        row_list = rows.tolist()
        outputs = [self.output_token_ids[r] for r in row_list]
        if self.plain[rows].all():
            return SamplingMetadata(
                temperature=torch.zeros(n, dtype=torch.float32, device=self.device),
                all_greedy=True,
                all_random=n == 0,
                top_k=None,
                top_p=None,
                min_p=None,
                seeds={},
                no_penalties=True,
                presence_penalties=None,
                frequency_penalties=None,
                repetition_penalties=None,
                prompt_token_ids=None,
                output_token_ids=outputs,
                min_tokens={},
                logit_bias=[None] * n,
                max_num_logprobs=None,
            )

        temperature = self.temperature[rows]
        num_greedy = int(np.count_nonzero(temperature == 0.0))
        top_k = self.top_k[rows]
        top_k = np.where((top_k < 0) | (top_k > vocab_size), vocab_size, top_k)
        top_p = self.top_p[rows]
        min_p = self.min_p[rows]
        no_penalties = not self.has_penalty[rows].any()
        num_logprobs = int(self.num_logprobs[rows].max(initial=-1))

        seeds: dict[int, tuple[int, int]] = {}
        min_tokens: dict[int, tuple[int, set[int]]] = {}
        if self.seeds or self.min_tokens:
            for i, r in enumerate(row_list):
                seed = self.seeds.get(r)
                if seed is not None:
                    offset = 0 if draft_pos is None else int(draft_pos[i])
                    seeds[i] = (seed, len(self.output_token_ids[r]) + offset)
                entry = self.min_tokens.get(r)
                if entry is not None:
                    # Out-of-range ids cannot be produced anyway; dropping them keeps the index op in bounds.
                    forbidden = {t for t in entry[1] if 0 <= t < vocab_size}
                    if forbidden:
                        min_tokens[i] = (entry[0], forbidden)
        allowed: dict[int, list[int]] = {}
        bad_words: dict[int, list[list[int]]] = {}
        if self.allowed_token_ids or self.bad_words:
            for i, r in enumerate(row_list):
                ids = self.allowed_token_ids.get(r)
                if ids is not None:
                    allowed[i] = [t for t in ids if 0 <= t < vocab_size]
                seqs = self.bad_words.get(r)
                if seqs is not None:
                    bad_words[i] = seqs
        logit_bias: list[dict[int, float] | None] = [None] * n
        if self.logit_bias:
            for i, r in enumerate(row_list):
                bias = self.logit_bias.get(r)
                if bias is not None:
                    # Out-of-range ids are dropped so a bad request cannot crash the whole batch with an index error.
                    logit_bias[i] = {t: v for t, v in bias.items() if 0 <= t < vocab_size} or None

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        prompt_tensor = None
        if not no_penalties:
            lens = self.num_prompt_tokens[rows]
            width = int(lens.max(initial=0))
            # Rows of token_ids start with the prompt; everything past a row's own prompt becomes the pad id.
            padded = np.where(np.arange(width) < lens[:, None], self.token_ids[rows, :width], vocab_size)
            prompt_tensor = dev(padded)
        return SamplingMetadata(
            temperature=dev(temperature),
            all_greedy=num_greedy == n,
            all_random=num_greedy == 0,
            top_k=dev(top_k) if (top_k < vocab_size).any() else None,
            top_p=dev(top_p) if (top_p < 1.0).any() else None,
            min_p=dev(min_p) if (min_p > 0.0).any() else None,
            seeds=seeds,
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else dev(self.presence_penalty[rows]),
            frequency_penalties=None if no_penalties else dev(self.frequency_penalty[rows]),
            repetition_penalties=None if no_penalties else dev(self.repetition_penalty[rows]),
            prompt_token_ids=prompt_tensor,
            output_token_ids=outputs,
            min_tokens=min_tokens,
            logit_bias=logit_bias,
            max_num_logprobs=None if num_logprobs < 0 else num_logprobs,
            allowed_token_ids=allowed,
            bad_words=bad_words,
        )

    def _take_row(self, state: CachedRequestState, block_ids: list[list[int]]) -> None:
        if state.row < 0:
            state.row = self.free_rows.pop()
        row = state.row
        prompt = state.prompt_token_ids
        self.token_ids[row, : len(prompt)] = prompt
        self.num_prompt_tokens[row] = len(prompt)
        if state.output_token_ids:
            self.token_ids[row, len(prompt) : state.num_tokens] = state.output_token_ids
        for g, ids in enumerate(block_ids):
            self.block_table[g, row, : len(ids)] = ids
            self.num_blocks[g, row] = len(ids)
        self._set_sampling_row(state)

    def _set_sampling_row(self, state: CachedRequestState) -> None:
        """Write the row's sampling state from the request's params (when it takes a row)."""
        row, p = state.row, state.sampling_params
        greedy = p.greedy
        self.temperature[row] = 0.0 if greedy else p.temperature
        self.top_k[row] = -1 if greedy else p.top_k
        self.top_p[row] = 1.0 if greedy else p.top_p
        self.min_p[row] = 0.0 if greedy else p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.has_penalty[row] = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.output_token_ids[row] = state.output_token_ids
        if p.logit_bias:
            self.logit_bias[row] = p.logit_bias
        if p.allowed_token_ids:
            self.allowed_token_ids[row] = p.allowed_token_ids
        if p.bad_words_token_ids:
            self.bad_words[row] = p.bad_words_token_ids
        # Only random rows draw: a greedy row's seed is deliberately left out.
        if p.seed is not None and not greedy:
            self.seeds[row] = p.seed
        forbidden = set(p.stop_token_ids or ())
        if state.eos_token_id is not None and not p.ignore_eos:
            forbidden.add(state.eos_token_id)
        if forbidden and len(state.output_token_ids) < p.min_tokens:
            self.min_tokens[row] = (p.min_tokens, forbidden)
        self._refresh_plain(row, p)

    def _refresh_plain(self, row: int, p: SamplingParams) -> None:
        self.plain[row] = (
            p.greedy
            and not self.has_penalty[row]
            and p.logprobs is None
            and row not in self.logit_bias
            and row not in self.min_tokens
            and row not in self.allowed_token_ids
            and row not in self.bad_words
        )

    def _append_blocks(self, state: CachedRequestState, block_ids: list[list[int]]) -> None:
        row = state.row
        for g, ids in enumerate(block_ids):
            if ids:
                start = int(self.num_blocks[g, row])
                self.block_table[g, row, start : start + len(ids)] = ids
                self.num_blocks[g, row] = start + len(ids)

    def _release_row(self, state: CachedRequestState) -> None:
        row = state.row
        if row >= 0:
            self.free_rows.append(row)
            self.seeds.pop(row, None)
            self.min_tokens.pop(row, None)
            self.logit_bias.pop(row, None)
            self.allowed_token_ids.pop(row, None)
            self.bad_words.pop(row, None)
            self.output_token_ids[row] = []
            state.row = -1
