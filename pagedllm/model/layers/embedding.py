"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous slice of the vocabulary; lookups outside the slice contribute zeros and are
summed across ranks, and the LM head's partial logits are gathered. On one device both are plain ops. A quantized
GGUF table that the native ops run stays as stored: lookups de-quantize their rows, and the LM head (its own table,
or the embedding's when tied) runs the quantized product.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.linear import (
    Bf16Panels,
    Panels,
    RowKinds,
    linear,
    pack_bf16_panels,
    pack_panels,
    pack_weight,
    panel_shape,
)
from pagedllm.model.quant import QuantParts, QuantTensor, keeps


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallelGroup | None = None,
        ops: Any = None,
    ) -> None:
        super().__init__()
        self.ops = ops  # the native CPU ops (quantized tables, few-row logits on panels), or None
        self.tp = tp or TensorParallelGroup()
        self.tp_size = self.tp.world_size
        self.tp_rank = self.tp.rank
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        # Not zeros: a quantized table never writes it (a 150k x 1k float32 table is 600 MB of pages touched for
        # nothing); the loader zeroes the padding rows of the last shard.
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.quant: QuantParts | None = None  # a quantized table as loaded, until pack_weights
        self.qweight: Any = None  # the native QuantMatrix of the table, once packed
        self.bf16_table: Any = None  # tied with --dtype bfloat16: the LM head's Bf16Panels, read in place of a table

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantTensor) -> None:
        part = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        if isinstance(part, QuantTensor):
            if part.shape[0] == self.shard_size and keeps(self.ops, part, self.embedding_dim):
                self.quant = QuantParts(self.shard_size, self.embedding_dim)
                self.quant.add(0, part)
                return
            if part.is_half and self.ops is not None:  # kept as stored; rows widened to float32 when read
                table = torch.zeros(self.shard_size, self.embedding_dim, dtype=part.half().dtype)
                table[: part.shape[0]].copy_(part.half())
                param.data = table
                return
            part = part.dequantize()
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def pack_weights(
        self, panels_out: torch.Tensor | None = None, quant_out: list[torch.Tensor] | None = None, bf16: bool = False
    ) -> bool:
        """Build the quantized table (into `quant_out` when given) and drop the float one; else with `bf16` keep the
        table in bfloat16 (rows widened to float32 when looked up)."""
        if self.quant is None:
            if (
                bf16
                and self.ops is not None
                and self.weight.dtype == torch.float32
                and type(self) is VocabParallelEmbedding
            ):
                self.weight.data = self.weight.data.bfloat16()
                return True
            return False
        self.qweight = self.quant.build(self.ops, quant_out)
        self.qweight_bytes = self.quant.packed  # what the matrix points into (quant.py)
        self.quant = None
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.ops.dequantize_rows(self.qweight, ids)
        if self.bf16_table is not None:  # row r: panel r // w, lane r % w, all its pairs
            panels = self.bf16_table.data
            flat = ids.reshape(-1)
            rows = panels[flat // panels.shape[2], :, flat % panels.shape[2], :].reshape(flat.shape[0], -1)
            return rows[:, : self.embedding_dim].float().view(*ids.shape, -1)
        if self.weight.dtype in (torch.bfloat16, torch.float16) and self.ops is not None:
            return F.embedding(ids, self.weight).float()
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        mask = (local < 0) | (local >= self.shard_size)
        out = self._lookup(local.masked_fill(mask, 0))
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto the vocabulary; may share its weight with the input embedding."""

    packed_weight: torch.Tensor | None = None
    panels: Panels | None = None
    bf16_panels: Bf16Panels | None = None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        ops: Any = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype, tp, ops)
        self.tied: VocabParallelEmbedding | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = embedding

    def _tied_quantized(self) -> bool:
        return self.tied is not None and (self.tied.quant is not None or self.tied.qweight is not None)

    def panel_shape(self, bf16: bool = False) -> tuple[int, ...] | None:
        if self.quant is not None or self.qweight is not None or self._tied_quantized():
            return None
        return panel_shape(self.weight, self.ops, bf16)

    def pack_weights(
        self, panels_out: torch.Tensor | None = None, quant_out: list[torch.Tensor] | None = None, bf16: bool = False
    ) -> bool:
        """Build the quantized table (tied: the embedding's, packed before this), else with `bf16` the bf16 panels,
        else oneDNN's copy and the panels (into `panels_out` when given: a tensor of `panel_shape(bf16)`); the plain
        weight, which may be the embedding's, is kept (untied and bf16: dropped)."""
        if self.tied is not None and self.tied.qweight is not None:
            self.qweight = self.tied.qweight
            return True
        if self.quant is not None:
            return super().pack_weights(panels_out, quant_out)
        half = self.weight.dtype in (torch.float16, torch.bfloat16)  # a GGUF's F16 or BF16 table, as stored
        if bf16 or half:
            # tied, the table is bf16 by now (the embedding packs first): its values are those of the float32 one
            self.bf16_panels = pack_bf16_panels(self.weight.float(), self.ops, panels_out if bf16 else None)
            if self.bf16_panels is not None:
                # one bf16 copy: tied, the embedding then reads its rows from these panels
                if self.tied is not None and self.tied.tp_size == 1:
                    self.tied.bf16_table = self.bf16_panels
                if self.tied is None or self.tied.bf16_table is not None:
                    self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
                return True
        self.packed_weight = pack_weight(self.weight)
        self.panels = pack_panels(self.weight, self.ops, panels_out)
        return self.packed_weight is not None or self.panels is not None

    def compute_logits(self, hidden: torch.Tensor, rows: RowKinds | None = None) -> torch.Tensor:
        """The logits of the rows of `hidden`; `rows`: their kinds (RowKinds), which a quantized head needs."""
        w = self.weight
        logits = linear(
            hidden, w, None, self.packed_weight, self.panels, self.ops, self.qweight, self.bf16_panels, rows
        )
        if self.tp_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.num_embeddings else logits[..., : self.num_embeddings]
