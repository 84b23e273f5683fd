"""The native encoder attention (csrc/cpu/attention.cpp `encoder_attention`: BERT's and RoBERTa's bidirectional
attention, no KV cache) against torch's SDPA run by run, for every ISA build this CPU runs (tests/model/conftest.py).

Runs of varied lengths in one call (1 token, fewer rows than a register block, remainders, a run past 4 vector
lengths, an empty run), head sizes of whole vectors (a specialised kernel: 8-64 columns with AVX2, 16-128 with
AVX-512) and not (20; 48 with AVX-512, 128 with AVX2), several heads, a scale that is not 1/sqrt(D), scores in the
hundreds (their exp overflows float32 unless the softmax subtracts its max); each output row equals what the run
alone gives (no leakage between runs or heads); bad input is refused. Whole-model agreement
with sentence-transformers and HF is in tests/engine/test_pooling.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def ops(isa_ops):
    return isa_ops


def _sdpa(qkv: torch.Tensor, starts: list[int], heads: int, dim: int, scale: float) -> torch.Tensor:
    """torch's SDPA run by run, in qkv's dtype."""
    out = torch.zeros(qkv.shape[0], heads * dim, dtype=qkv.dtype)
    for a, b in zip(starts, starts[1:]):
        if b == a:
            continue
        q, k, v = qkv[a:b].view(b - a, 3, heads, dim).permute(1, 2, 0, 3)
        out[a:b] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1).reshape(b - a, -1)
    return out


@pytest.mark.parametrize("dim", [8, 16, 20, 32, 48, 64, 96, 128])
def test_matches_sdpa_run_by_run(ops, dim: int) -> None:
    heads = 3
    lens = [1, 3, 5, 17, 0, 70, 2, 129]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(starts[-1], 3 * heads * dim, generator=gen) * 8  # scores spread ~45: the max must come off
    scale = 0.7 / dim**0.5
    got = ops.encoder_attention(qkv, torch.tensor(starts), heads, dim, scale)
    assert got.shape == (starts[-1], heads * dim) and got.dtype == torch.float32
    # Within a few times the error of torch's own float32 attention against float64.
    exact = _sdpa(qkv.double(), starts, heads, dim, scale)
    torch_error = (_sdpa(qkv, starts, heads, dim, scale).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 4 * torch_error + 1e-6
    # A run's rows are what the run alone gives, bit for bit: nothing reads another run's tokens.
    a, b = starts[5], starts[6]
    alone = ops.encoder_attention(qkv[a:b].contiguous(), torch.tensor([0, b - a]), heads, dim, scale)
    assert torch.equal(alone, got[a:b])


def test_the_bert_layer_takes_the_native_kernel(ops) -> None:
    """models/bert.py's encoder_attention gives the native result with SIMD ops and torch's without (the generic
    build keeps torch's, which is faster than its 4-lane vectors)."""
    from pagedllm.model.models.bert import encoder_attention

    starts = [0, 7, 40]
    qkv = torch.randn(40, 3 * 4 * 32, generator=torch.Generator().manual_seed(1))
    via = encoder_attention(qkv, starts, 4, 32, 32**-0.5, ops)
    native = ops.encoder_attention(qkv, torch.tensor(starts), 4, 32, 32**-0.5)
    plain = encoder_attention(qkv, starts, 4, 32, 32**-0.5)
    assert torch.equal(via, native if ops.isa != "generic" else plain)
    torch.testing.assert_close(via, plain, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused(ops) -> None:
    qkv = torch.randn(10, 3 * 2 * 16)
    with pytest.raises(RuntimeError, match=r"3 \* heads \* dim"):
        ops.encoder_attention(qkv, torch.tensor([0, 10]), 2, 8, 0.25)
    with pytest.raises(RuntimeError, match="from 0 to the number of tokens"):
        ops.encoder_attention(qkv, torch.tensor([0, 9]), 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="must not decrease"):
        ops.encoder_attention(qkv, torch.tensor([0, 6, 4, 10]), 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        ops.encoder_attention(qkv, torch.tensor([0, 10], dtype=torch.int32), 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        ops.encoder_attention(qkv.double(), torch.tensor([0, 10]), 2, 16, 0.25)
