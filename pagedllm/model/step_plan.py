"""The layout of one model step, as the model runner hands it to the model's forward.

Contract. The model runner (worker/model_runner.py) builds one `StepPlan` a step for the tokens the layer path runs
and passes it to `model(input_ids, plan)`; every layer reads from it what it needs: attention its positions and its
KV cache group's metadata (which holds the slots the step's keys and values go to), every linear the kinds of its
input rows (`rows`: which are generated tokens, whose inputs quantized weights take as int8). Nothing of a step
lives in module or thread state. The head is given the kinds of the rows it computes logits for
(`compute_logits(hidden, rows)`), which the runner selects from the whole step's, fused rows included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.model.layers.linear import RowKinds


@dataclass
class StepPlan:
    positions: torch.Tensor  # [T] each token's position in its request
    # The attention metadata of the step's tokens: one object, or a list with one per KV cache group (an attention
    # layer takes its group's, layers/attention.py). Each holds its group's slots and block tables.
    attn_metadata: Any
    rows: RowKinds  # the kinds of the T rows (model/layers/linear.py); no default: a quantized weight never guesses
    order: list[str] = field(default_factory=list)  # the request of each run of rows, in row order


@dataclass
class EncoderPlan:
    """An encoder model's step (models/bert.py): its requests' whole prompts back to back, no KV cache."""

    positions: torch.Tensor  # [T] each token's position in its request
    token_types: torch.Tensor | None  # [T] token type ids (a cross-encoder's pair); None: all type 0
    starts: list[int]  # [num_reqs + 1] request i's tokens are rows [starts[i], starts[i + 1])
    # Called between two layers and within them (the engine core's express lane, engine/core.py); it may run other
    # steps meanwhile.
    poll: Callable[[], None] | None = None
