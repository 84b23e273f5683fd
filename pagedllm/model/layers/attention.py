"""The attention layer: multi-head attention with grouped KV heads over a paged KV cache.

The layer owns its shape and its cache; how it attends is its backend's (pagedllm/model/attention/backends), given
when the layer is built (the dispatch object the loader hands the model). The step's metadata, built once a step by
that backend, arrives as the forward argument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.attention.backends.base import AttentionBackend


class Attention(nn.Module):
    """`kv_cache` is bound by the worker after it allocates memory: a pair of tensors
    [num_blocks, block_size, num_kv_heads, head_dim] for keys and values. `sliding_window` (0: none): a query at
    position p attends only the keys at p - sliding_window + 1 .. p, as transformers' sliding-window layers do.
    `kv_group` (set by the worker, core/kv_cache_layout.py): the KV cache group whose block tables this layer reads;
    a step's metadata is one object, or a list with one per group."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 0:
            raise ValueError(f"sliding_window must be positive (or None), got {sliding_window}")
        self.sliding_window = int(sliding_window or 0)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_group = 0
        # Attention-logit soft-capping (Gemma 2): each scaled score s becomes cap * tanh(s / cap); 0: none.
        self.logit_softcap = 0.0
        # Attention sinks (gpt-oss): one logit per (this rank's) query head [num_heads] in each row's softmax
        # denominator, with no value; None: none. The model that has them sets this parameter and loads it.
        self.sinks: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq * D]."""
        if isinstance(metadata, list):
            metadata = metadata[self.kv_group]
        return self.backend.forward(self, q, k, v, metadata)
