"""Pooling: a request's hidden states -> one vector (MEAN, CLS, LAST) or all of them (ALL), then what its task asks:
normalised (and Matryoshka-cut) embeddings, or a classification head's scores with their activation.

Contract. `PoolingState(type)` accumulates a request's rows chunk by chunk (`add(rows, first_position,
prompt_len)`); `result()` is the pooled tensor ([hidden], or [tokens, hidden] for ALL). MEAN is the mean over every
prompt token, special tokens included, as sentence-transformers' mean pooling of an unpadded input.
`finish_pooling([(req_id, params, pooled)], classify)` applies each request's task (params verified, pooling_params.py):
embed/encode: `pooled[..., :dimensions]` then L2-normalised where `normalize`; classify/score: `classify(pooled)`
(the model's head, one batch for all such requests) then sigmoid (one label) or softmax (several) where
`use_activation`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class PoolingState:
    __slots__ = ("kind", "first", "last", "total", "count", "rows")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.first: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor, first_position: int, prompt_len: int) -> None:
        """Rows [n, hidden] of positions first_position .. first_position + n - 1 of a prompt of prompt_len."""
        if self.kind == "CLS":
            if first_position == 0:
                self.first = rows[0].clone()
        elif self.kind == "LAST":
            if first_position + rows.shape[0] >= prompt_len:
                self.last = rows[prompt_len - 1 - first_position].clone()
        elif self.kind == "MEAN":
            part = rows.sum(0, dtype=torch.float32)
            self.total = part if self.total is None else self.total + part
            self.count += rows.shape[0]
        else:  # ALL
            self.rows.append(rows.clone())

    def result(self) -> torch.Tensor:
        if self.kind == "CLS":
            assert self.first is not None
            return self.first
        if self.kind == "LAST":
            assert self.last is not None
            return self.last
        if self.kind == "MEAN":
            assert self.total is not None
            return self.total / self.count
        return torch.cat(self.rows) if len(self.rows) > 1 else self.rows[0]


def _activate(logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def finish_pooling(
    done: list[tuple[str, Any, torch.Tensor]], classify: Callable[[torch.Tensor], torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Each finished request's result (req_id -> float tensor), by its task."""
    out: dict[str, torch.Tensor] = {}
    heads = [(r, p, t) for r, p, t in done if p.task in ("classify", "score")]
    if heads:
        if classify is None:
            raise RuntimeError("a classify/score request reached a model without a classification head")
        logits = classify(torch.stack([t.to(torch.float32) for _, _, t in heads])).to(torch.float32)
        for (req_id, params, _), row in zip(heads, logits):
            out[req_id] = _activate(row) if params.use_activation else row
    for req_id, params, pooled in done:
        if req_id in out:
            continue
        v = pooled.to(torch.float32)
        if params.dimensions is not None:
            v = v[..., : params.dimensions]
        if params.normalize:
            v = F.normalize(v, p=2.0, dim=-1)
        out[req_id] = v
    return out
