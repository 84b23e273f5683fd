"""What every attention backend shares: the batch layout it is given once a step, and its interface.

Contract. The model runner lays a step out as a flat run of tokens: the decodes first (requests with exactly one
new token, by ascending context length), then one segment per request with several new tokens (a prompt chunk,
possibly after cached or earlier-computed context). It describes that layout once in a `CommonAttentionMetadata`;
the engine's backend turns it into its own metadata (`build_metadata`, once a step), which reaches every attention
layer as the model's forward argument. A layer calls `backend.forward(layer, q, k, v, metadata)`, which writes the
new keys and values into the layer's paged cache at their slots, for every token and before any read (so a request
may read blocks another request of the same batch is filling: a prefix-cache hit on blocks scheduled in the same
step), and returns the attention output [T, Hq * D].

Where a new backend goes: a file beside this one with a subclass of `AttentionBackend`, and its name in selector.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch


class AttentionLayer(Protocol):
    """What a backend reads of the layer it attends for (pagedllm.model.layers.attention.Attention)."""

    num_heads: int
    head_dim: int
    num_kv_heads: int
    scale: float
    sliding_window: int  # 0: full attention; else a query at p sees the keys at p - sliding_window + 1 .. p
    logit_softcap: float  # > 0: each scaled score s becomes logit_softcap * tanh(s / logit_softcap) (Gemma 2)
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None  # [num_blocks, block_size, num_kv_heads, head_dim] each


@dataclass(slots=True)
class CommonAttentionMetadata:
    """One step's batch layout (decodes first, then multi-token segments), as numpy arrays on the host."""

    num_decodes: int  # the first num_decodes requests (and tokens) are single-token requests
    query_start: np.ndarray  # [num_reqs + 1] int64: request i's tokens are [query_start[i], query_start[i + 1])
    context_lens: np.ndarray  # [num_reqs] int64: tokens already in the cache before this step
    slot_mapping: np.ndarray  # [num_tokens] int64: block_id * block_size + offset of each new token
    block_table: np.ndarray  # [max_reqs, max_blocks] int64: the persistent table, one row per batch slot
    rows: np.ndarray  # [num_reqs] int64: each request's row in block_table
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    def query_lens(self) -> np.ndarray:  # [num_reqs]
        return np.diff(self.query_start)

    def tables(self, first: int, last: int, tokens: int) -> np.ndarray:
        """[last - first, blocks] block-table rows of requests [first, last), wide enough for `tokens` tokens."""
        return table_rows(self.block_table, self.rows[first:last], tokens, self.block_size)


def table_rows(block_table: np.ndarray, rows: np.ndarray, tokens: int, block_size: int) -> np.ndarray:
    """[len(rows), blocks] contiguous copy of the given rows of a block table, wide enough for `tokens` tokens."""
    return np.ascontiguousarray(block_table[rows, : -(-tokens // block_size)])


class AttentionBackend(ABC):
    """An attention implementation: a name, a per-step metadata builder and a forward."""

    name: ClassVar[str]

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, device: torch.device) -> Any:
        """This backend's metadata for one step (tensors on `device`)."""

    @abstractmethod
    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] of the step's tokens -> [T, Hq * D], the new k and v cached."""

    @staticmethod
    def write_kv(layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's keys and values at their slots of the layer's cache."""
        assert layer.kv_cache is not None, "KV cache not bound to this attention layer"
        k_cache, v_cache = layer.kv_cache
        if k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, slot_mapping, v)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (no copy on the CPU)."""
    return torch.from_numpy(a).to(device, non_blocking=True)
