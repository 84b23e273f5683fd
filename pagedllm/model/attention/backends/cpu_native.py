"""The `cpu_native` attention backend: the C++ paged attention kernels (pagedllm/csrc/cpu/attention.cpp).

Per layer, after the new keys and values are cached: one kernel call over every decode of the batch and one over
every multi-token segment, keys and values read in place from their blocks (no padding, no mask, no gather).
float32 on the CPU only (the selector checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from pagedllm.model.attention.backends.base import (
    AttentionBackend,
    AttentionLayer,
    CommonAttentionMetadata,
    to_device,
)


@dataclass(slots=True)
class CpuNativeAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64: context including the new token
    prefill_segments: torch.Tensor | None  # [num_segments, 3] int64: query start, query length, context length
    prefill_tables: torch.Tensor | None  # [num_segments, max_blocks] int64


class CpuNativeAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "cpu_native"

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def build_metadata(self, common: CommonAttentionMetadata, device: torch.device) -> CpuNativeAttentionMetadata:
        nd, n = common.num_decodes, common.num_reqs
        decode_tables = decode_lens = segments = seg_tables = None
        if nd:
            seq_lens = common.context_lens[:nd] + 1
            decode_tables = to_device(common.tables(0, nd, int(seq_lens.max())), device)
            decode_lens = to_device(seq_lens, device)
        if nd < n:
            info = np.stack(
                [common.query_start[nd:n], common.query_lens()[nd:], common.context_lens[nd:]], axis=1
            ).astype(np.int64)
            segments = to_device(info, device)
            seg_tables = to_device(common.tables(nd, n, int((info[:, 1] + info[:, 2]).max())), device)
        return CpuNativeAttentionMetadata(
            to_device(common.slot_mapping, device), nd, decode_tables, decode_lens, segments, seg_tables
        )

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: CpuNativeAttentionMetadata,
    ) -> torch.Tensor:
        self.write_kv(layer, k, v, metadata.slot_mapping)
        k_cache, v_cache = layer.kv_cache
        out = torch.empty(q.shape[0], layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        nd = metadata.num_decodes
        window = getattr(layer, "sliding_window", 0) or 0  # a query sees only the last `window` keys (0: all)
        softcap = getattr(layer, "logit_softcap", 0.0)  # scores capped to cap * tanh(s / cap) (0: none)
        if nd:
            # The decodes are the first rows: the kernel writes straight into them.
            self.ops.paged_decode_attention(
                out[:nd], q[:nd].contiguous(), k_cache, v_cache, metadata.decode_tables, metadata.decode_seq_lens,
                layer.scale, window, softcap, layer.sinks,
            )  # fmt: skip
        if metadata.prefill_segments is not None:
            self.ops.paged_prefill_attention(
                out,
                q,
                k_cache,
                v_cache,
                metadata.prefill_tables,
                metadata.prefill_segments,
                layer.scale,
                window,
                softcap,
                layer.sinks,
            )
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)
