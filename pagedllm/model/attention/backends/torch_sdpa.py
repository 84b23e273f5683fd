"""The `torch` attention backend: paged attention in plain device-agnostic torch (the reference; runs on CUDA too).

Per layer, after the new keys and values are cached:
* decodes attend in a few groups of similar context length (the runner sorts them by length, so padding stays
  small): each group's block tables gather its context into one padded tensor and a mask hides the padding;
* each multi-token segment attends on its own: causal over its fresh keys when it has no context, otherwise over
  the context gathered from its blocks plus itself with a causal offset mask.
A layer with a sliding window (`layer.sliding_window` > 0) masks, in both, the keys more than the window behind each
query: a query at position p sees p - window + 1 .. p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.model.attention.backends.base import (
    AttentionBackend,
    AttentionLayer,
    CommonAttentionMetadata,
    to_device,
)

# Padding a decode group may waste, as a fraction of its padded size: fewer wasted key reads than one padded
# batch, far fewer calls than one per request (the trade-off measured in bench/RESULTS.md).
MAX_GROUP_WASTE = 0.05


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
    lens: torch.Tensor | None = None  # [n] int64 context lengths (the new token's included)


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    workspace: GatherWorkspace | None = None


class GatherWorkspace:
    """Reused buffers that attention gathers cached blocks into, one for keys and one for values.

    Every layer gathers its context out of the paged cache; into a fresh multi-megabyte tensor each time,
    `index_select` ran several times slower on the CPU than into a reused one (the fresh pages fault in). The gathered
    tensor only lives until that layer's attention has read it, so one pair of buffers, grown on demand, serves every
    layer and group in turn.
    """

    sleep_scratch = True  # not weights: sleep mode (worker/sleep.py) leaves these buffers alone

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

    def gather_as(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """gather, in `dtype` (the queries': a KV cache of another dtype, --kv-cache-dtype, is widened or narrowed
        after the gather, only the rows read)."""
        out = self.gather(cache, blocks, slot)
        return out if out.dtype == dtype else out.to(dtype)


def length_groups(sorted_lens: np.ndarray, max_waste: float = MAX_GROUP_WASTE) -> list[tuple[int, int]]:
    """Split ascending context lengths into runs whose padding to the run's longest stays under max_waste of the
    padded size."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, length in enumerate(sorted_lens.tolist()):
        padded = (i - start + 1) * length
        if i > start and padded - (total + length) > max_waste * padded:
            groups.append((start, i))
            start, total = i, 0
        total += length
    groups.append((start, len(sorted_lens)))
    return groups


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention ([B, H, Lq, D] queries, [B, Hkv, Lk, D] keys and values, a boolean mask
    of what is seen), or, with an attention-logit soft-cap (Gemma 2) or attention sinks (gpt-oss: one logit per head
    [H] joining each row's softmax without a value), the same written out: scores scaled, capped to
    cap * tanh(s / cap), masked, softmax (over the row and its head's sink), values."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


class TorchAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "torch"

    def __init__(self) -> None:
        self.workspace = GatherWorkspace()

    def build_metadata(self, common: CommonAttentionMetadata, device: torch.device) -> TorchAttentionMetadata:
        bs, nd = common.block_size, common.num_decodes
        meta = TorchAttentionMetadata(slot_mapping=to_device(common.slot_mapping, device), workspace=self.workspace)
        seq_lens = common.context_lens[:nd] + 1  # ascending
        for start, end in length_groups(seq_lens) if nd else []:
            lens = seq_lens[start:end]
            max_len = int(lens[-1])
            table = common.tables(start, end, max_len)
            mask = None
            if lens[0] != max_len:
                span = np.arange(table.shape[1] * bs)
                mask = to_device(span[None, :] < lens[:, None], device).view(end - start, 1, 1, -1)
            group = DecodeGroup(start, end, to_device(table, device), mask, max_len, to_device(lens.copy(), device))
            meta.decode_groups.append(group)
        for i in range(nd, common.num_reqs):
            ctx, q = int(common.context_lens[i]), int(common.query_start[i + 1] - common.query_start[i])
            seg = PrefillSegment(query_start=int(common.query_start[i]), query_len=q, context_len=ctx)
            if ctx > 0:
                seg.block_table = to_device(common.tables(i, i + 1, ctx + q)[0], device)
                seg.mask = torch.ones(q, ctx + q, dtype=torch.bool, device=device).tril(diagonal=ctx)
            meta.prefills.append(seg)
        return meta

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchAttentionMetadata
    ) -> torch.Tensor:
        self.write_kv(layer, k, v, metadata.slot_mapping)
        out = torch.empty(q.shape[0], layer.num_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        for group in metadata.decode_groups:
            out[group.start : group.end] = self._decode(layer, q[group.start : group.end], group)
        for seg in metadata.prefills:
            s, e = seg.query_start, seg.query_start + seg.query_len
            out[s:e] = self._prefill(layer, q[s:e], k[s:e], v[s:e], seg)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
        return self.workspace.gather_as(cache, blocks, slot, dtype)

    def _decode(self, layer: AttentionLayer, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        k_cache, v_cache = layer.kv_cache
        n, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        # Gather [n * max_blocks, block_size, Hkv, D] (index_select is several times faster than advanced indexing
        # on the CPU) and view it as [n, L, Hkv, D] without a second copy.
        flat = group.block_table.view(-1)
        keys = self._gather(k_cache, flat, 0, q.dtype).view(n, -1, hkv, d)
        values = self._gather(v_cache, flat, 1, q.dtype).view(n, -1, hkv, d)
        mask = group.mask
        window = getattr(layer, "sliding_window", 0) or 0
        if mask is None:  # no padding in the gathered blocks: trim to the exact length
            keys, values = keys[:, : group.max_len], values[:, : group.max_len]
        if window and group.max_len > window:
            span = torch.arange(keys.shape[1], device=q.device)
            lens = group.lens.view(-1, 1)
            mask = ((span < lens) & (span >= lens - window)).view(n, 1, 1, -1)
        o = sdpa(
            q.view(n, 1, layer.num_heads, d).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            mask,
            False,
            layer.scale,
            getattr(layer, "logit_softcap", 0.0),
            getattr(layer, "sinks", None),
        )
        return o.view(n, layer.num_heads, d)

    def _prefill(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment
    ) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        window = getattr(layer, "sliding_window", 0) or 0
        mask = seg.mask
        if window and seg.context_len + seg.query_len > window:
            # query i (position context_len + i) sees keys j with context_len + i - window < j <= context_len + i
            rows = torch.arange(seg.query_len, device=q.device).view(-1, 1) + seg.context_len
            cols = torch.arange(seg.context_len + seg.query_len, device=q.device).view(1, -1)
            mask = (cols <= rows) & (cols > rows - window)
        if seg.context_len == 0:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = sdpa(qh, kh, vh, mask, mask is None, layer.scale, getattr(layer, "logit_softcap", 0.0), layer.sinks)
        else:
            k_cache, v_cache = layer.kv_cache
            total = seg.context_len + seg.query_len
            hkv, d = layer.num_kv_heads, layer.head_dim
            table = seg.block_table
            kh = self._gather(k_cache, table, 0, q.dtype).view(-1, hkv, d)[:total].transpose(0, 1).unsqueeze(0)
            vh = self._gather(v_cache, table, 1, q.dtype).view(-1, hkv, d)[:total].transpose(0, 1).unsqueeze(0)
            o = sdpa(qh, kh, vh, mask, False, layer.scale, getattr(layer, "logit_softcap", 0.0), layer.sinks)
        return o.squeeze(0).transpose(0, 1)  # [Lq, Hq, D]
