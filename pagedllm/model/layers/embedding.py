"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous slice of the vocabulary; lookups outside the slice contribute zeros and are
summed across ranks, and the LM head's partial logits are gathered. On one device both are plain ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.linear import Panels, linear, pack_panels, pack_weight, panel_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup()
        self.tp_size = self.tp.world_size
        self.tp_rank = self.tp.rank
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        part = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto the vocabulary; may share its weight with the input embedding."""

    packed_weight: torch.Tensor | None = None
    panels: Panels | None = None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp)
        self.ops = ops  # the native CPU ops (few-row logits on panels), or None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def panel_shape(self) -> tuple[int, int, int] | None:
        return panel_shape(self.weight, self.ops)

    def pack_weights(self, panels_out: torch.Tensor | None = None) -> bool:
        """Build oneDNN's copy and the panels (into `panels_out` when given: a tensor of `panel_shape()`); the plain
        weight, which may be the embedding's, is kept."""
        self.packed_weight = pack_weight(self.weight)
        self.panels = pack_panels(self.weight, self.ops, panels_out)
        return self.packed_weight is not None or self.panels is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed_weight, self.panels, self.ops)
        if self.tp_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.num_embeddings else logits[..., : self.num_embeddings]
