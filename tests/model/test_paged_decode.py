"""The fused paged decode attention (`paged_decode_attention`) against SDPA on gathered keys and values.

Random caches and block tables with scattered, repeated and padded block ids; requests of different lengths in
one call (shorter ones masked by their seq_lens); grouped KV heads. Checked eager and under torch.compile (the
engine's default path; the compiled graph is shared by the whole process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers.attention import compiled_paged_decode, paged_decode_attention


def reference(q, k_cache, v_cache, table, lens, scale):
    out = []
    hq, d = q.shape[1], q.shape[2]
    for i in range(q.shape[0]):
        n = int(lens[i])
        keys = k_cache[table[i]].flatten(0, 1)[:n]  # [n, Hkv, D]
        values = v_cache[table[i]].flatten(0, 1)[:n]
        o = F.scaled_dot_product_attention(
            q[i].view(1, hq, 1, d),
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )
        out.append(o.view(hq, d))
    return torch.stack(out)


def make_case(seed: int, n: int, width: int, hq: int = 6, hkv: int = 2, d: int = 16, block: int = 4):
    g = torch.Generator().manual_seed(seed)
    blocks = 40
    k_cache = torch.randn(blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block, hkv, d, generator=g)
    table = torch.randint(0, blocks, (n, width), generator=g)
    lens = torch.randint(1, width * block + 1, (n,), generator=g)
    lens[0] = width * block  # one request fills every block
    q = torch.randn(n, hq, d, generator=g)
    return q, k_cache, v_cache, table, lens, d**-0.5


@pytest.mark.parametrize("n,width", [(1, 1), (2, 3), (5, 7), (9, 2)])
def test_eager_matches_sdpa(n: int, width: int) -> None:
    case = make_case(seed=n * 100 + width, n=n, width=width)
    torch.testing.assert_close(paged_decode_attention(*case), reference(*case), atol=1e-5, rtol=1e-5)


def test_compiled_matches_sdpa_across_shapes() -> None:
    fn = compiled_paged_decode()
    for n, width in [(2, 3), (6, 5), (3, 11)]:  # dynamic shapes: one graph serves them all
        case = make_case(seed=n + width, n=n, width=width)
        torch.testing.assert_close(fn(*case), reference(*case), atol=1e-5, rtol=1e-5)
