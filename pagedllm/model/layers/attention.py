"""Paged attention over a block KV cache, in plain device-agnostic torch.

The batch is a flat run of tokens from many requests (no padding to the longest request). The model runner
orders it decodes first (requests with exactly one new token), then one segment per request with several
new tokens (a prompt chunk, possibly after cached or earlier-computed context). Per layer:

1. the new keys and values are written into the cache at their slots (`slot_mapping`), for every token,
   before any read, so a request may read blocks another request of the same batch is filling (that is
   how a prefix-cache hit on blocks scheduled in the same step works);
2. all decodes attend together: their block tables gather the context into one padded tensor and an
   additive mask hides the padding;
3. each multi-token segment attends on its own: causal over its fresh keys when it has no context,
   otherwise over the context gathered from its blocks plus itself with a causal offset mask.

The metadata is built once per step by the model runner and passed down explicitly, never via a global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class PrefillSegment:
    """One request whose scheduled tokens are more than one."""

    query_start: int  # offset of its first token in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor | None = None  # [num_blocks] int64, only when context_len > 0
    mask: torch.Tensor | None = None  # [query_len, context_len + query_len] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decodes: int = 0  # the first num_decodes tokens are single-token requests
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] additive float
    prefills: list[PrefillSegment] = field(default_factory=list)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads reading and writing a paged cache.

    `kv_cache` is bound by the worker after it allocates memory: a pair of tensors
    [num_blocks, block_size, num_kv_heads, head_dim] for keys and values.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq * D]."""
        assert self.kv_cache is not None, "KV cache not bound to this attention layer"
        k_cache, v_cache = self.kv_cache
        hkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty(q.shape[0], self.num_heads, d, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache, meta)
        for seg in meta.prefills:
            s, e = seg.query_start, seg.query_start + seg.query_len
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, seg)
        return out.view(q.shape[0], self.num_heads * d)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = q.shape[0]
        table = meta.decode_block_table
        hkv, d = self.num_kv_heads, self.head_dim
        # [n, max_blocks, block_size, Hkv, D] -> [n, Hkv, L, D]
        keys = k_cache[table].view(n, -1, hkv, d).transpose(1, 2)
        values = v_cache[table].view(n, -1, hkv, d).transpose(1, 2)
        qg = q.view(n, hkv, self.group, d)  # grouped query heads share their KV head without a copy
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # [n, Hkv, G, L]
        scores = scores + meta.decode_mask
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(n, self.num_heads, d)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if seg.context_len == 0:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            total = seg.context_len + seg.query_len
            hkv, d = self.num_kv_heads, self.head_dim
            kh = k_cache[seg.block_table].view(-1, hkv, d)[:total].transpose(0, 1).unsqueeze(0)
            vh = v_cache[seg.block_table].view(-1, hkv, d)[:total].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=seg.mask, scale=self.scale, enable_gqa=True
            )
        return o.squeeze(0).transpose(0, 1)  # [Lq, Hq, D]
