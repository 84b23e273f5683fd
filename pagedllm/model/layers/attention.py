"""Paged attention over a block KV cache, in plain device-agnostic torch.

The batch is a flat run of tokens from many requests (no padding to the longest request). The model runner
orders it decodes first (requests with exactly one new token), then one segment per request with several
new tokens (a prompt chunk, possibly after cached or earlier-computed context). Per layer:

1. the new keys and values are written into the cache at their slots (`slot_mapping`), for every token,
   before any read, so a request may read blocks another request of the same batch is filling (that is
   how a prefix-cache hit on blocks scheduled in the same step works);
2. decodes attend in a few groups of similar context length (the runner sorts them by length, so padding
   stays small): each group's block tables gather its context into one padded tensor and a mask hides
   the padding;
3. each multi-token segment attends on its own: causal over its fresh keys when it has no context,
   otherwise over the context gathered from its blocks plus itself with a causal offset mask.

With the native backend (the default on the CPU in float32, see cpu_kernels.py), steps 2 and 3 are instead one
call each of a C++ kernel, over every decode and over every multi-token segment of the batch (no padding, no
mask, no gather): they read keys and values in place from their blocks. Elsewhere (other devices and dtypes, or
`attention_backend="torch"`) steps 2 and 3 are the torch path.

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
class DecodeGroup:
    """Consecutive single-token requests attended together."""

    start: int  # first token (= request) of the group in the flat batch
    end: int
    block_table: torch.Tensor  # [n, max_blocks] int64
    mask: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool, True = attend; None if no padding
    max_len: int = 0  # context length of the longest request in the group
    seq_lens: torch.Tensor | None = None  # [n] int64 context length of each request (native kernel only)


class GatherWorkspace:
    """Reused buffers that attention gathers cached blocks into, one for keys and one for values.

    Every layer gathers its context out of the paged cache; into a fresh multi-megabyte tensor each time,
    `index_select` ran 3-4x slower on the CPU than into a reused one (the fresh pages fault in), and at 64
    decodes of 320 tokens the gathers were 58 % of a step. The gathered tensor only lives until that layer's
    attention has read it, so one pair of buffers, grown on demand, serves every layer and group in turn.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        """cache [num_blocks, ...] rows `blocks` (flat int64) -> [len(blocks), ...] in buffer `slot` (0 or 1)."""
        shape = (blocks.numel(), *cache.shape[1:])
        numel = blocks.numel() * cache[0].numel()
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty(numel + numel // 4, dtype=cache.dtype, device=cache.device)
            self._buffers[slot] = buf
        out = buf[:numel].view(shape)
        return torch.index_select(cache, 0, blocks, out=out)


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    num_decodes: int = 0  # the first num_decodes tokens are single-token requests
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    workspace: GatherWorkspace | None = None  # reused gather buffers (the model runner keeps one)
    # Native kernel only: every prefill segment in one call, [n, 3] (query start, query length, context length)
    # and each segment's block table [n, max_blocks] (its segments then carry no block table or mask).
    prefill_segments: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int) -> torch.Tensor:
        if self.workspace is None:
            return cache.index_select(0, blocks)
        return self.workspace.gather(cache, blocks, slot)


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
        self.decode_op = None  # the native paged decode kernel, set by the model runner when it uses it
        self.prefill_op = None  # the native paged prefill kernel, likewise

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq * D]."""
        assert self.kv_cache is not None, "KV cache not bound to this attention layer"
        k_cache, v_cache = self.kv_cache
        hkv, d = self.num_kv_heads, self.head_dim
        if k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape[0], self.num_heads, d, dtype=q.dtype, device=q.device)
        for group in meta.decode_groups:
            dst, qg = out[group.start : group.end], q[group.start : group.end]
            if self.decode_op is not None and group.seq_lens is not None:
                # The native kernel writes straight into its rows of `out` (contiguous: the first rows).
                self.decode_op(dst, qg.contiguous(), k_cache, v_cache, group.block_table, group.seq_lens, self.scale)
            else:
                dst.copy_(self._decode(qg, k_cache, v_cache, group, meta))
        if meta.prefills and self.prefill_op is not None and meta.prefill_segments is not None:
            # Every segment in one call, its keys and values read in place from the blocks written above.
            self.prefill_op(out, q, k_cache, v_cache, meta.prefill_tables, meta.prefill_segments, self.scale)
            return out.view(q.shape[0], self.num_heads * d)
        for seg in meta.prefills:
            s, e = seg.query_start, seg.query_start + seg.query_len
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, seg, meta)
        return out.view(q.shape[0], self.num_heads * d)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        # Gather [n * max_blocks, block_size, Hkv, D] (index_select is several times faster than advanced
        # indexing on CPU) and view it as [n, Hkv, L, D] without a second copy.
        flat = group.block_table.view(-1)
        keys = meta.gather(k_cache, flat, 0).view(n, -1, hkv, d)
        values = meta.gather(v_cache, flat, 1).view(n, -1, hkv, d)
        if group.mask is None:  # no padding in the gathered blocks: trim to the exact length
            keys, values = keys[:, : group.max_len], values[:, : group.max_len]
        o = F.scaled_dot_product_attention(
            q.view(n, 1, self.num_heads, d).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.view(n, self.num_heads, d)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seg: PrefillSegment,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if seg.context_len == 0:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            total = seg.context_len + seg.query_len
            hkv, d = self.num_kv_heads, self.head_dim
            table = seg.block_table
            kh = meta.gather(k_cache, table, 0).view(-1, hkv, d)[:total].transpose(0, 1).unsqueeze(0)
            vh = meta.gather(v_cache, table, 1).view(-1, hkv, d)[:total].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seg.mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # [Lq, Hq, D]
