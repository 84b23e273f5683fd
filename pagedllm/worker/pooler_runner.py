"""PoolerRunner: the model runner's pooling side (`--runner pooling`): prompts' hidden states -> pooled results.

Contract. `pool(order, states, starts, cu, hidden)` takes one step's hidden states of the requests in `order` (request
i's rows are hidden[cu[i]:cu[i + 1]], its positions from starts[i]) and folds each request's rows into its pooling
(CLS: the first position; LAST: the last; MEAN: a running sum; ALL: every row), which survives prompt chunks on
the request's state. A request whose prompt is complete gets its result: embed and encode normalise (and cut to
`dimensions` first) where its params say; classify and score run the model's head (`model.classify`) and its
activation (sigmoid for one label, softmax for several) unless `use_activation` is false. Results go back as
`ModelRunnerOutput.pooler_output` (float32 bytes and shape), nothing is sampled.
`run_encoder(batch, counts)` runs an encoder's step: each scheduled request's whole prompt (the scheduler never
chunks them), token types from a cross-encoder pair's split, then `pool`. Between and within the layers it
calls `poll` when set (the express lane), which may run a whole other step through `run_encoder` meanwhile (the
input batch then gains rows; this step's inputs and states are already taken); the hook is off while it runs.
The layer arithmetic is in layers/pooler.py; this module only lays out the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.engine.protocol import PooledData
from pagedllm.model.layers.pooler import PoolingState, finish_pooling
from pagedllm.model.step_plan import EncoderPlan


class PoolerRunner:
    def __init__(self, model: Any, model_config: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.encoder = bool(model_config.is_encoder)
        self.pooling_type = model_config.pooler_config.pooling_type
        self.classify = getattr(model, "classify", None)
        # Called between and within the layers of an encoder's step (Worker.set_poll_hook: the express lane).
        self.poll: Callable[[], None] | None = None

    def _poll(self) -> None:
        """The hook, with itself off while it runs: the steps it runs do not call it again."""
        hook, self.poll = self.poll, None
        try:
            assert hook is not None
            hook()
        finally:
            self.poll = hook

    def run_encoder(self, batch: Any, counts: dict[str, int]) -> ModelRunnerOutput:
        order = list(counts)
        states = [batch.requests[r] for r in order]
        n_tok = np.array([counts[r] for r in order], dtype=np.int64)
        for state, n in zip(states, n_tok):
            if state.num_computed_tokens != 0 or n != len(state.prompt_token_ids):
                raise RuntimeError(f"encoder request {state.req_id} was scheduled in part: {n} tokens")
        cu = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(n_tok, out=cu[1:])
        positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], n_tok)
        rows = np.repeat(np.array([s.row for s in states], dtype=np.int64), n_tok)
        input_ids = batch.token_ids[rows, positions]
        splits = [s.pooling_params.token_type_split for s in states]
        types = None
        if any(split is not None for split in splits):
            first = np.repeat(np.array([n if sp is None else sp for sp, n in zip(splits, n_tok)]), n_tok)
            types = torch.from_numpy((positions >= first).astype(np.int64)).to(self.device)
        hook = self._poll if self.poll is not None else None
        plan = EncoderPlan(torch.from_numpy(positions).to(self.device), types, cu.tolist(), hook)
        hidden = self.model(torch.from_numpy(input_ids).to(self.device), plan)
        return self.pool(order, states, np.zeros(len(order), dtype=np.int64), cu, hidden)

    def pool(
        self, order: list[str], states: list[Any], starts: np.ndarray, cu: np.ndarray, hidden: torch.Tensor
    ) -> ModelRunnerOutput:
        done: list[tuple[str, Any, torch.Tensor]] = []
        for i, state in enumerate(states):
            if state.pooled is None or int(starts[i]) == 0:  # a fresh start, or a recompute after preemption
                state.pooled = PoolingState(self.pooling_type)
            a, b = int(cu[i]), int(cu[i + 1])
            prompt_len = len(state.prompt_token_ids)
            state.pooled.add(hidden[a:b], int(starts[i]), prompt_len)
            if int(starts[i]) + (b - a) >= prompt_len:
                done.append((order[i], state.pooling_params, state.pooled.result()))
                state.pooled = None
        out: dict[str, PooledData] = {}
        for req_id, result in finish_pooling(done, self.classify).items():
            data = result.detach().to(torch.float32).contiguous().cpu()
            out[req_id] = PooledData(data.numpy().tobytes(), list(data.shape))
        return ModelRunnerOutput(order, [[] for _ in order], pooler_output=out)
