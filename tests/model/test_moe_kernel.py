"""The fused experts kernel (csrc/cpu/moe.cpp, `ops.moe_layer`) on every ISA build, against a per-token reference
made of the dense kernels: each row alone, routed by torch (`route`), its experts one by one in ascending order, each
projection through the same build's dense linear (`quant_linear` for quantized experts, with the row's int8 flag;
`bf16_panel_linear`; float32 in float64), the weighted sum in float32. The kernel groups a step's rows by expert, so
the cases have rows that share experts, experts no row picks (one row of 64 experts) and every expert picked (many
rows of 6). Quantized experts come from the tests' llama.cpp quantizers with real signs (Q4_K and Q6_K with signed
scales) and widths that are not multiples of 256 (Q5_0, Q8_0, IQ4_NL on 96-wide rows). Rows are also checked bit
for bit against themselves alone (a row's result does not depend on the others), and a mix of int8 and panel rows
against each kind alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pagedllm.model.layers.linear import RowKinds
from pagedllm.model.layers.moe import MoEMLP, route
from pagedllm.model.quant import QuantTensor
from tests import quant_utils as qu

# (experts, top_k, hidden, inter, gate/up type, down type)
QUANT_CASES = {
    "k-types": (6, 2, 256, 512, qu.Q4_K, qu.Q6_K),
    "legacy-96": (64, 8, 288, 96, qu.Q5_0, qu.Q8_0),
    "iq4-nl": (8, 3, 160, 64, qu.IQ4_NL, qu.Q4_1),
}


def _layer(ops: Any, experts: int, top_k: int, hidden: int, inter: int, renorm: bool, seed: int) -> MoEMLP:
    layer = MoEMLP(hidden, inter, experts, top_k, renorm, torch.float32, ops)
    g = torch.Generator().manual_seed(seed)
    layer.gate.weight.data.copy_(torch.randn(experts, hidden, generator=g))
    return layer


def _quant(w: torch.Tensor, qtype: int) -> QuantTensor:
    return QuantTensor(qtype, torch.from_numpy(qu.quantize(w.numpy(), qtype)), tuple(w.shape))


def _dense(ops: Any, v: torch.Tensor, m: Any, int8: bool) -> torch.Tensor:
    """One row on a dense quantized weight, on int8 inputs or on the de-quantized panels as `int8` says. The kernel
    takes the row's kind whether or not the build packs the type; the dense linear does so for packed weights only
    and runs other types on int8 up to quant_dot_max_rows rows, on panels beyond: there the row goes in with enough
    copies of itself (each row's sums are its own, so its copy's result is its result alone)."""
    copies = 1 if int8 else ops.quant_dot_max_rows() + 1
    return ops.quant_linear(v.expand(copies, -1).contiguous(), m, None, int8)[:1]


def _reference(
    ops: Any, layer: MoEMLP, x: torch.Tensor, int8: list[bool], experts: list[tuple[Any, Any]]
) -> torch.Tensor:
    """Each row alone through the dense kernels: experts[e] = (W13, W2) as the dense linears take them."""
    weights, ids = route(torch.nn.functional.linear(x, layer.gate.weight), layer.top_k, layer.renormalize)
    out = torch.zeros_like(x)
    inter = layer.intermediate_size
    for r in range(x.shape[0]):
        for j in sorted(range(layer.top_k), key=lambda j: int(ids[r, j])):
            w13, w2 = experts[int(ids[r, j])]
            gu = w13(x[r : r + 1], int8[r])
            h = torch.empty(1, inter)
            ops.silu_and_mul(h, gu)
            out[r] += weights[r, j] * w2(h, int8[r])[0]
    return out


def _check(layer: MoEMLP, ref_of, x: torch.Tensor) -> None:
    rows = x.shape[0]
    kinds = {"int8": [True] * rows, "panels": [False] * rows, "mixed": [r % 3 == 0 for r in range(rows)]}
    alone = {}
    for name, int8 in kinds.items():
        mask = torch.tensor(int8)
        got = layer(x, RowKinds(mask) if name == "mixed" else RowKinds(int8[0]))
        torch.testing.assert_close(got, ref_of(int8), rtol=2e-5, atol=2e-5 * float(got.abs().max()))
        if name != "mixed":
            alone[name] = got
            one = layer(x[rows // 2 : rows // 2 + 1], RowKinds(int8[0]))
            assert torch.equal(one[0], got[rows // 2]), "a row's result depends on the other rows"
        else:
            assert torch.equal(got[mask], alone["int8"][mask]) and torch.equal(got[~mask], alone["panels"][~mask])


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantized_experts_match_per_token_dense_kernels(isa_ops: Any, case: str) -> None:
    E, k, H, inter, t13, t2 = QUANT_CASES[case]
    layer = _layer(isa_ops, E, k, H, inter, renorm=case != "iq4-nl", seed=3)
    g = torch.Generator().manual_seed(4)
    experts = []
    for e in range(E):
        gate, up = (torch.randn(inter, H, generator=g) * 0.05 for _ in range(2))
        down = torch.randn(H, inter, generator=g) * 0.05
        q13 = [_quant(gate, t13), _quant(up, t13)]
        q2 = _quant(down, t2)
        layer.weight_loader(layer.w13_weight, q13[0], e, "gate_proj")
        layer.weight_loader(layer.w13_weight, q13[1], e, "up_proj")
        layer.weight_loader(layer.w2_weight, q2, e, "down_proj")
        # the reference's own copies (quant_matrix rewrites its bytes into the build's layout)
        m13 = isa_ops.quant_matrix([t13, t13], [q.data.clone() for q in q13], H)
        m2 = isa_ops.quant_matrix([t2], [q2.data.clone()], inter)
        experts.append(
            (lambda v, int8, m=m13: _dense(isa_ops, v, m, int8), lambda v, int8, m=m2: _dense(isa_ops, v, m, int8))
        )
    assert layer.pack_weights() and layer.quantized
    gx = torch.Generator().manual_seed(5)
    for rows in (1, 3, 41):
        x = torch.randn(rows, H, generator=gx)
        _, ids = route(x @ layer.gate.weight.T, k, True)
        picked = set(ids.flatten().tolist())
        if rows == 1:
            assert len(picked) == k < E  # experts no row picks
        if rows == 41 and E <= 8:
            assert picked == set(range(E))  # every expert, most by several rows
        _check(layer, lambda int8, x=x: _reference(isa_ops, layer, x, int8, experts), x)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_float_experts_match_per_token_dense_kernels(isa_ops: Any, bf16: bool) -> None:
    E, k, H, inter = 6, 2, 72, 40
    layer = _layer(isa_ops, E, k, H, inter, renorm=True, seed=6)
    g = torch.Generator().manual_seed(7)
    layer.w13_weight.data.copy_(torch.randn(E, 2 * inter, H, generator=g) * 0.1)
    layer.w2_weight.data.copy_(torch.randn(E, H, inter, generator=g) * 0.1)
    w13, w2 = layer.w13_weight.data.clone(), layer.w2_weight.data.clone()
    if bf16:
        p13 = [isa_ops.bf16_pack_panels(w13[e].contiguous()) for e in range(E)]
        p2 = [isa_ops.bf16_pack_panels(w2[e].contiguous()) for e in range(E)]
        experts = [
            (
                lambda v, _, p=p13[e]: isa_ops.bf16_panel_linear(v, p, None, 2 * inter),
                lambda v, _, p=p2[e]: isa_ops.bf16_panel_linear(v, p, None, H),
            )
            for e in range(E)
        ]
    else:
        experts = [
            (
                lambda v, _, w=w13[e]: (v.double() @ w.double().T).float(),
                lambda v, _, w=w2[e]: (v.double() @ w.double().T).float(),
            )
            for e in range(E)
        ]
    assert layer.pack_weights(bf16=bf16) and not layer.quantized
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(8))
    _check(layer, lambda int8: _reference(isa_ops, layer, x, int8, experts), x)


def test_top_k_of_logits_then_softmax_routing(isa_ops: Any) -> None:
    """gpt-oss's router (scoring 1): the top k logits, softmax over them alone, with a router bias."""
    E, k, H, inter = 8, 3, 64, 32
    g = torch.Generator().manual_seed(9)
    router, bias = torch.randn(E, H, generator=g), torch.randn(E, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 0.1, torch.randn(E, H, inter, generator=g) * 0.1
    p13 = torch.stack([isa_ops.pack_panels(w13[e].contiguous()) for e in range(E)])
    p2 = torch.stack([isa_ops.pack_panels(w2[e].contiguous()) for e in range(E)])
    layer = isa_ops.moe_layer(
        isa_ops.pack_panels(router), bias, k, 1, False, 0, 0.0, 0.0, H, inter, w13_panels=p13, w2_panels=p2
    )
    x = torch.randn(5, H, generator=g)
    logits = x.double() @ router.double().T + bias.double()
    top, ids = logits.topk(k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    ref = torch.zeros(5, H, dtype=torch.float64)
    for r in range(5):
        for j in range(k):
            gu = w13[ids[r, j]].double() @ x[r].double()
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            ref[r] += weights[r, j] * (w2[ids[r, j]].double() @ h)
    torch.testing.assert_close(layer(x, False).double(), ref, rtol=1e-4, atol=1e-4)


def test_clamped_swiglu_activation(isa_ops: Any) -> None:
    """gpt-oss's expert activation (act 1): gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate *
    sigmoid(alpha * gate), with the experts' biases."""
    E, k, H, inter, alpha, limit = 4, 2, 48, 24, 1.702, 7.0
    g = torch.Generator().manual_seed(10)
    router = torch.randn(E, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 2, torch.randn(E, H, inter, generator=g) * 0.1
    b13, b2 = torch.randn(E, 2 * inter, generator=g) * 3, torch.randn(E, H, generator=g)
    p13 = torch.stack([isa_ops.pack_panels(w13[e].contiguous()) for e in range(E)])
    p2 = torch.stack([isa_ops.pack_panels(w2[e].contiguous()) for e in range(E)])
    layer = isa_ops.moe_layer(
        isa_ops.pack_panels(router), None, k, 0, True, 1, alpha, limit, H, inter,
        w13_panels=p13, w2_panels=p2, b13=b13, b2=b2,
    )  # fmt: skip
    x = torch.randn(7, H, generator=g)
    weights, ids = route((x.double() @ router.double().T).float(), k, True)
    ref = torch.zeros(7, H, dtype=torch.float64)
    clamped = 0
    for r in range(7):
        for j in range(k):
            e = int(ids[r, j])
            gu = w13[e].double() @ x[r].double() + b13[e].double()
            gate, up = gu[:inter], gu[inter:]
            clamped += int((gate > limit).sum() + (up.abs() > limit).sum())
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            ref[r] += float(weights[r, j]) * (w2[e].double() @ h + b2[e].double())
    assert clamped > 0  # the clamps are exercised
    torch.testing.assert_close(layer(x, False).double(), ref, rtol=1e-4, atol=1e-4)


def test_bad_moe_layer_arguments_are_clear_errors(isa_ops: Any) -> None:
    router = isa_ops.pack_panels(torch.randn(4, 32))
    p13 = torch.stack([isa_ops.pack_panels(torch.randn(16, 32)) for _ in range(4)])
    p2 = torch.stack([isa_ops.pack_panels(torch.randn(32, 8)) for _ in range(4)])
    with pytest.raises(RuntimeError, match="top_k must be in 1..4"):
        isa_ops.moe_layer(router, None, 5, 0, True, 0, 0.0, 0.0, 32, 8, w13_panels=p13, w2_panels=p2)
    with pytest.raises(RuntimeError, match="W13 panels must be"):
        isa_ops.moe_layer(router, None, 2, 0, True, 0, 0.0, 0.0, 32, 40, w13_panels=p13, w2_panels=p2)
    layer = isa_ops.moe_layer(router, None, 2, 0, True, 0, 0.0, 0.0, 32, 8, w13_panels=p13, w2_panels=p2)
    with pytest.raises(RuntimeError, match="x must be"):
        layer(torch.randn(3, 31), False)
    np.testing.assert_equal(layer.num_experts, 4)
