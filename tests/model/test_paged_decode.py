"""The native paged decode attention kernel (csrc/cpu/attention.cpp), for every ISA build this CPU runs, against
SDPA on gathered keys and values.

Random caches and block tables with scattered and repeated block ids; requests of different lengths in one call
(each reads only its first seq_lens[i] tokens); grouped KV heads; float32 and bfloat16 caches; the head sizes the
kernel specialises (64, 128: with AVX-512 tiles of 16 tokens, with AVX2 of 8 on a bfloat16 cache, across blocks of
2-32 tokens and query heads in register runs of one to four) and generic ones; bad tables are refused with an error
instead of reading outside the cache. The kernels are built by the install: the tests fail (not skip) where they are
missing while a compiler exists (tests/model/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def reference(q, k_cache, v_cache, table, lens, scale, window: int = 0):
    """SDPA over each request's gathered keys: its first lens[i], or with a window the last `window` of those."""
    out = []
    hq, d = q.shape[1], q.shape[2]
    for i in range(q.shape[0]):
        n = int(lens[i])
        lo = max(0, n - window) if window else 0
        keys = k_cache[table[i]].flatten(0, 1)[lo:n]  # [n - lo, Hkv, D]
        values = v_cache[table[i]].flatten(0, 1)[lo:n]
        o = F.scaled_dot_product_attention(
            q[i].view(1, hq, 1, d),
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )
        out.append(o.view(hq, d))
    return torch.stack(out)


def make_case(seed: int, n: int, width: int, hq: int, hkv: int, d: int, block: int):
    g = torch.Generator().manual_seed(seed)
    blocks = 40
    k_cache = torch.randn(blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block, hkv, d, generator=g)
    table = torch.randint(0, blocks, (n, width), generator=g)
    lens = torch.randint(1, width * block + 1, (n,), generator=g)
    lens[0] = width * block  # one request fills every block
    q = torch.randn(n, hq, d, generator=g)
    return q, k_cache, v_cache, table, lens, d**-0.5


@pytest.mark.parametrize(
    "n, width, hq, hkv, d, block",
    [
        (1, 1, 9, 3, 64, 16),  # SmolLM2's heads
        (5, 7, 9, 3, 64, 16),
        (64, 13, 9, 3, 64, 16),
        (3, 4, 8, 2, 128, 8),
        (4, 9, 6, 6, 128, 4),  # no grouping
        (9, 6, 16, 2, 128, 16),  # eight query heads a KV head: value accumulators in runs of two
        (6, 3, 12, 1, 64, 32),  # twelve query heads on one KV head, in runs of four
        (7, 5, 6, 2, 16, 4),  # a head size without its own specialisation
        (2, 3, 4, 1, 40, 2),
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa(
    isa_ops, n: int, width: int, hq: int, hkv: int, d: int, block: int, kv_dtype: torch.dtype
) -> None:
    """Each case in a float32 and a bfloat16 cache (with AVX2 only the bfloat16 one runs the tiles)."""
    op = isa_ops.paged_decode_attention
    q, k_cache, v_cache, table, lens, scale = make_case(n * 100 + width, n, width, hq, hkv, d, block)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = torch.full_like(q, float("nan"))
    op(out, q, k_cache, v_cache, table, lens, scale)
    expected = reference(q, k_cache.float(), v_cache.float(), table, lens, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "n, width, hq, hkv, d, block",
    [(5, 7, 9, 3, 64, 16), (64, 13, 9, 3, 64, 16), (3, 4, 8, 2, 128, 8), (7, 5, 6, 2, 16, 4)],
)
@pytest.mark.parametrize("window", [1, 5, 37])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(
    isa_ops, n: int, width: int, hq: int, hkv: int, d: int, block: int, window: int, kv_dtype: torch.dtype
) -> None:
    """A sliding window: each request attends its last `window` tokens (all of them where it has fewer), windows
    that start inside a block, at one token, and past a tile's 16."""
    q, k_cache, v_cache, table, lens, scale = make_case(n * 31 + window, n, width, hq, hkv, d, block)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = torch.full_like(q, float("nan"))
    isa_ops.paged_decode_attention(out, q, k_cache, v_cache, table, lens, scale, window)
    expected = reference(q, k_cache.float(), v_cache.float(), table, lens, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if int(lens.max()) > window:  # the window changes the result where a context is longer
        full = torch.full_like(q, float("nan"))
        isa_ops.paged_decode_attention(full, q, k_cache, v_cache, table, lens, scale)
        assert not torch.allclose(full, out)


@pytest.mark.parametrize(
    "n, width, hq, hkv, d, block", [(5, 7, 9, 3, 64, 16), (3, 4, 8, 2, 128, 8), (7, 5, 6, 2, 16, 4)]
)
def test_kernel_bf16_cache(isa_ops, n: int, width: int, hq: int, hkv: int, d: int, block: int) -> None:
    """A bfloat16 cache (--kv-cache-dtype bfloat16) is read widened: the result is SDPA's over the same values in
    float32, to float32 accuracy (the specialised AVX-512 path and the generic one)."""
    op = isa_ops.paged_decode_attention
    q, k_cache, v_cache, table, lens, scale = make_case(n * 31 + d, n, width, hq, hkv, d, block)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.full_like(q, float("nan"))
    op(out, q, kb, vb, table, lens, scale)
    torch.testing.assert_close(out, reference(q, kb.float(), vb.float(), table, lens, scale), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(out, q, kb, v_cache, table, lens, scale)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(out, q, k_cache.half(), v_cache.half(), table, lens, scale)


@pytest.mark.parametrize("bad", ["block id", "seq_len zero", "seq_len past table", "dtype"])
def test_kernel_refuses_bad_input(isa_ops, bad: str) -> None:
    op = isa_ops.paged_decode_attention
    q, k_cache, v_cache, table, lens, scale = make_case(1, 3, 4, 6, 2, 16, 4)
    if bad == "block id":
        table[1, 0] = k_cache.shape[0]
    elif bad == "seq_len zero":
        lens[2] = 0
    elif bad == "seq_len past table":
        lens[0] = table.shape[1] * k_cache.shape[1] + 1
    else:
        q = q.double()
    with pytest.raises(RuntimeError):
        op(torch.empty_like(q), q, k_cache, v_cache, table, lens, scale)


def capped_reference(q, k_cache, v_cache, table, lens, scale, window: int, cap: float):
    """Soft-capped attention written out (as transformers' Gemma 2): scores scaled, cap * tanh(s / cap), softmax."""
    out = []
    hq = q.shape[1]
    for i in range(q.shape[0]):
        n = int(lens[i])
        lo = max(0, n - window) if window else 0
        keys = k_cache[table[i]].flatten(0, 1)[lo:n].transpose(0, 1)  # [Hkv, n - lo, D]
        values = v_cache[table[i]].flatten(0, 1)[lo:n].transpose(0, 1)
        g = hq // keys.shape[0]
        keys, values = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
        scores = torch.einsum("hd,hld->hl", q[i], keys) * scale
        p = torch.softmax(torch.tanh(scores / cap) * cap, dim=-1)
        out.append(torch.einsum("hl,hld->hd", p, values))
    return torch.stack(out)


@pytest.mark.parametrize(
    "n, width, hq, hkv, d, block", [(5, 7, 9, 3, 64, 16), (3, 4, 8, 2, 128, 8), (7, 5, 6, 2, 16, 4)]
)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_logit_softcap(
    isa_ops, n: int, width: int, hq: int, hkv: int, d: int, block: int, window: int, kv_dtype: torch.dtype
) -> None:
    """Attention-logit soft-capping (Gemma 2), with and without a window, in the tiles and the generic path: scores
    large enough (queries x 4, cap 2) that the cap changes the result."""
    q, k_cache, v_cache, table, lens, scale = make_case(n * 17 + d, n, width, hq, hkv, d, block)
    q = q * 4
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = torch.full_like(q, float("nan"))
    isa_ops.paged_decode_attention(out, q, k_cache, v_cache, table, lens, scale, window, 2.0)
    expected = capped_reference(q, k_cache.float(), v_cache.float(), table, lens, scale, window, 2.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, reference(q, k_cache.float(), v_cache.float(), table, lens, scale, window))
