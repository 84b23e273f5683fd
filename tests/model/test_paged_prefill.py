"""The native paged prefill attention kernel (csrc/cpu/attention.cpp), for every ISA build this CPU runs, against
SDPA on gathered keys and values.

Several segments in one call, each with its own query rows, context already in the cache and scattered block
table; queries strided the way the fused q/k/v projection leaves them; grouped KV heads; the head sizes the kernel
specialises (64, 128) and generic ones; segment lengths that are not a multiple of the kernel's 16-row tiles.
Bad segments and tables are refused with an error instead of reading outside the cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def reference(q, k_cache, v_cache, tables, segments, scale, window: int = 0):
    """Each segment: causal attention with offset over its gathered context plus itself (with a window, row i at
    position ctx + i sees only the keys after ctx + i - window)."""
    out = torch.full_like(q, float("nan"))
    hq, d = q.shape[1], q.shape[2]
    for (start, length, ctx), table in zip(segments.tolist(), tables):
        total = ctx + length
        keys = k_cache[table].flatten(0, 1)[:total].transpose(0, 1)[None]  # [1, Hkv, total, D]
        values = v_cache[table].flatten(0, 1)[:total].transpose(0, 1)[None]
        mask = torch.ones(length, total, dtype=torch.bool).tril(diagonal=ctx)
        if window:
            mask &= torch.ones(length, total, dtype=torch.bool).triu(diagonal=ctx - window + 1)
        qs = q[start : start + length].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + length] = o[0].transpose(0, 1)
    return out.view(-1, hq, d)


def make_case(seed: int, segs: list[tuple[int, int]], hq: int, hkv: int, d: int, block: int):
    """segs: (query length, context length) per segment; queries strided inside a wider q/k/v row."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-(q + c) // block) for q, c in segs) + 1
    blocks = width * len(segs) + 3
    k_cache = torch.randn(blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block, hkv, d, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in segs])
    starts = [sum(q for q, _ in segs[:i]) + 2 for i in range(len(segs))]  # two rows before: not a segment's
    segments = torch.tensor([[s, q, c] for s, (q, c) in zip(starts, segs)], dtype=torch.int64)
    tokens = starts[-1] + segs[-1][0] + 1
    qkv = torch.randn(tokens, hq + 2 * hkv, d, generator=g)
    return qkv[:, :hq], k_cache, v_cache, tables, segments, d**-0.5


@pytest.mark.parametrize(
    "segs, hq, hkv, d, block",
    [
        ([(256, 0)], 9, 3, 64, 16),  # SmolLM2's heads, a fresh prompt
        ([(7, 0), (33, 40), (1 + 16, 100), (50, 3)], 9, 3, 64, 16),  # chunks after context, in one call
        ([(20, 0), (18, 9)], 8, 2, 128, 8),
        ([(19, 5)], 6, 6, 128, 4),  # no grouping
        ([(21, 0), (5, 13)], 6, 2, 16, 4),  # head sizes without their own specialisation
        ([(9, 2)], 4, 1, 40, 2),
    ],
)
def test_kernel_matches_sdpa(isa_ops, segs, hq: int, hkv: int, d: int, block: int) -> None:
    module = isa_ops
    q, k_cache, v_cache, tables, segments, scale = make_case(len(segs) * 7 + d, segs, hq, hkv, d, block)
    assert not q.is_contiguous()
    out = torch.full_like(q, float("nan")).contiguous()
    module.paged_prefill_attention(out, q, k_cache, v_cache, tables, segments, scale)
    ref = reference(q, k_cache, v_cache, tables, segments, scale)
    rows = torch.cat([torch.arange(s, s + n) for s, n, _ in segments.tolist()])
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    assert out[others].isnan().all(), "rows outside every segment were written"


@pytest.mark.parametrize(
    "segs, hq, hkv, d, block",
    [
        ([(256, 0)], 9, 3, 64, 16),
        ([(7, 0), (33, 40), (1 + 16, 100), (50, 3)], 9, 3, 64, 16),
        ([(20, 0), (18, 9)], 8, 2, 128, 8),
        ([(21, 0), (5, 13)], 6, 2, 16, 4),
    ],
)
@pytest.mark.parametrize("window", [1, 7, 20, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(isa_ops, segs, hq: int, hkv: int, d: int, block: int, window: int, kv_dtype) -> None:
    """A sliding window: windows of one token, shorter and longer than the 16-row and 8-key tiles, starting in the
    context or inside the chunk; rows whose window holds no key of a whole tile."""
    q, k_cache, v_cache, tables, segments, scale = make_case(len(segs) * 13 + window, segs, hq, hkv, d, block)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = torch.full_like(q, float("nan")).contiguous()
    isa_ops.paged_prefill_attention(out, q, k_cache, v_cache, tables, segments, scale, window)
    ref = reference(q, k_cache.float(), v_cache.float(), tables, segments, scale, window)
    rows = torch.cat([torch.arange(s, s + n) for s, n, _ in segments.tolist()])
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "segs, hq, hkv, d, block", [([(7, 0), (33, 40)], 9, 3, 64, 16), ([(21, 0), (5, 13)], 6, 2, 16, 4)]
)
def test_kernel_bf16_cache(isa_ops, segs, hq: int, hkv: int, d: int, block: int) -> None:
    """A bfloat16 cache (--kv-cache-dtype bfloat16) is read widened: SDPA's result over the same values in float32."""
    q, k_cache, v_cache, tables, segments, scale = make_case(len(segs) * 11 + d, segs, hq, hkv, d, block)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.full_like(q, float("nan")).contiguous()
    isa_ops.paged_prefill_attention(out, q, kb, vb, tables, segments, scale)
    ref = reference(q, kb.float(), vb.float(), tables, segments, scale)
    rows = torch.cat([torch.arange(s, s + n) for s, n, _ in segments.tolist()])
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["block id", "past the table", "rows past q", "empty segment", "dtype", "shape"])
def test_kernel_refuses_bad_input(isa_ops, bad: str) -> None:
    module = isa_ops
    q, k_cache, v_cache, tables, segments, scale = make_case(3, [(10, 4), (6, 0)], 6, 2, 16, 4)
    out = torch.empty(q.shape)
    if bad == "block id":
        tables[0, 1] = k_cache.shape[0]
    elif bad == "past the table":
        segments[1, 2] = tables.shape[1] * k_cache.shape[1]
    elif bad == "rows past q":
        segments[1, 0] = q.shape[0] - 2
    elif bad == "empty segment":
        segments[0, 1] = 0
    elif bad == "dtype":
        q = q.double()
    else:
        out = torch.empty(q.shape[0], q.shape[1] + 1, q.shape[2])
    with pytest.raises(RuntimeError):
        module.paged_prefill_attention(out, q, k_cache, v_cache, tables, segments, scale)


def capped_reference(q, k_cache, v_cache, tables, segments, scale, window: int, cap: float):
    """Soft-capped causal attention written out (transformers' Gemma 2): cap * tanh(s / cap), then the mask."""
    out = torch.full_like(q, float("nan"))
    hq = q.shape[1]
    for (start, length, ctx), table in zip(segments.tolist(), tables):
        total = ctx + length
        keys = k_cache[table].flatten(0, 1)[:total].transpose(0, 1)  # [Hkv, total, D]
        values = v_cache[table].flatten(0, 1)[:total].transpose(0, 1)
        g = hq // keys.shape[0]
        keys, values = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
        mask = torch.ones(length, total, dtype=torch.bool).tril(diagonal=ctx)
        if window:
            mask &= torch.ones(length, total, dtype=torch.bool).triu(diagonal=ctx - window + 1)
        qs = q[start : start + length].transpose(0, 1)  # [Hq, length, D]
        scores = torch.tanh(torch.einsum("hqd,hkd->hqk", qs, keys) * scale / cap) * cap
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[start : start + length] = torch.einsum("hqk,hkd->hqd", p, values).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    "segs, hq, hkv, d, block",
    [([(7, 0), (33, 40), (1 + 16, 100)], 9, 3, 64, 16), ([(20, 0), (18, 9)], 8, 2, 128, 8), ([(21, 0)], 6, 2, 16, 4)],
)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_logit_softcap(isa_ops, segs, hq: int, hkv: int, d: int, block: int, window: int, kv_dtype) -> None:
    """Attention-logit soft-capping (Gemma 2) in the prefill tiles, capped before the causal and window masks; scores
    large enough (queries x 4, cap 2) that the cap changes the result."""
    q, k_cache, v_cache, tables, segments, scale = make_case(len(segs) * 29 + window, segs, hq, hkv, d, block)
    q = q * 4
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = torch.full_like(q, float("nan")).contiguous()
    isa_ops.paged_prefill_attention(out, q, k_cache, v_cache, tables, segments, scale, window, 2.0)
    ref = capped_reference(q, k_cache.float(), v_cache.float(), tables, segments, scale, window, 2.0)
    rows = torch.cat([torch.arange(s, s + n) for s, n, _ in segments.tolist()])
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)
    plain = reference(q, k_cache.float(), v_cache.float(), tables, segments, scale, window)
    assert not torch.allclose(out[rows], plain[rows])
