"""The bfloat16 linear kernels (csrc/cpu/bf16.cpp), once per ISA build this CPU runs.

* `bf16_pack_panels` rounds every weight to bf16 as torch does (round to nearest even) and lays them out in pair
  panels [ceil(O / w), ceil(I / 2), w, 2], zero past O and I.
* `bf16_panel_linear` equals the float64 product of the bf16-rounded input and weight, up to float32 summation:
  every product of two bf16 is exact in float32, so the only error is the sum's (bounded by n * 2^-24 * sum |x w|).
  A kernel that misreads a pair, a lane or the odd tail lands far outside that.
* A row's result does not depend on the other rows of the call (each row has its own accumulators).
* `bf16_native()` is true exactly in the build that multiplies in hardware (avx512bf16).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ops(isa_ops):
    return isa_ops


def _unpack(panels: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The [out, in] bf16 weight a pair panel holds."""
    p, half, w, _ = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(p * w, half * 2)[:out, :inp]


@pytest.mark.parametrize(("out", "inp"), [(64, 96), (45, 77), (1, 2), (33, 1)])
def test_pack_panels_rounds_like_torch_and_zero_pads(ops, out: int, inp: int) -> None:
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out))
    panels = ops.bf16_pack_panels(w)
    width = ops.panel_width()
    assert panels.dtype == torch.bfloat16
    assert tuple(panels.shape) == (-(-out // width), -(-inp // 2), width, 2) == tuple(ops.bf16_panel_shape(out, inp))
    assert torch.equal(_unpack(panels, out, inp), w.bfloat16())
    full = panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * width, -1).float()
    assert not full[out:].any() and not full[:, inp:].any()
    into = torch.empty(ops.bf16_panel_shape(out, inp), dtype=torch.bfloat16)
    assert ops.bf16_pack_panels(w, into).data_ptr() == into.data_ptr()
    assert torch.equal(into, panels)


@pytest.mark.parametrize("rows", [1, 2, 5, 13, 14, 15, 29, 70, 300])
@pytest.mark.parametrize(("out", "inp"), [(96, 128), (45, 77), (40, 601)])  # 601: three slices of the panel
def test_panel_linear_is_the_bf16_product(ops, rows: int, out: int, inp: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + inp)
    w, x, bias = torch.randn(out, inp, generator=g), torch.randn(rows, inp, generator=g), torch.randn(out, generator=g)
    panels = ops.bf16_pack_panels(w)
    got = ops.bf16_panel_linear(x, panels, bias, out).double()
    ref = x.bfloat16().double() @ w.bfloat16().double().T + bias.double()
    bound = inp * 2.0**-24 * (x.abs().double() @ w.abs().double().T) + 1e-6
    assert torch.all((got - ref).abs() <= bound)
    nobias = ops.bf16_panel_linear(x, panels, None, out).double()
    assert torch.all((nobias - (ref - bias.double())).abs() <= bound)


def test_a_rows_result_does_not_depend_on_the_batch(ops) -> None:
    g = torch.Generator().manual_seed(7)
    for inp in (160, 600):  # one slice of the panel, and three
        w, x, b = torch.randn(70, inp, generator=g), torch.randn(40, inp, generator=g), torch.randn(70, generator=g)
        panels = ops.bf16_pack_panels(w)
        whole = ops.bf16_panel_linear(x, panels, b, 70)
        for m in (0, 13, 14, 39):
            assert torch.equal(ops.bf16_panel_linear(x[m : m + 1].contiguous(), panels, b, 70)[0], whole[m])
        assert torch.equal(ops.bf16_panel_linear(x[5:30].contiguous(), panels, b, 70), whole[5:30])


def test_native_only_in_the_bf16_build(ops) -> None:
    assert ops.bf16_native() == (ops.isa == "avx512bf16")


def test_bad_input_is_refused(ops) -> None:
    w = torch.randn(40, 64)
    panels = ops.bf16_pack_panels(w)
    with pytest.raises(RuntimeError, match="bf16 panels must be"):
        ops.bf16_panel_linear(torch.randn(2, 62), panels, None, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_panel_linear(torch.randn(2, 64), panels.float(), None, 40)
    with pytest.raises(RuntimeError, match=r"bias must be \[O\]"):
        ops.bf16_panel_linear(torch.randn(2, 64), panels, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="non-empty"):
        ops.bf16_pack_panels(torch.randn(0, 64))


@pytest.mark.parametrize("inp", [3001, 3072])  # 3,072: AMX's rows where the CPU has it (pairs in whole tiles)
def test_rows_in_blocks_are_the_same_bits(ops, inp: int) -> None:
    """Rows beyond about 768 KiB of inputs go block by block past every panel (300 rows of ~3,000 inputs: 3 blocks
    on every build): a row's result is the same bits whether or where its call was split, and the product."""
    g = torch.Generator().manual_seed(8)
    w, x, b = torch.randn(70, inp, generator=g), torch.randn(300, inp, generator=g), torch.randn(70, generator=g)
    panels = ops.bf16_pack_panels(w)
    whole = ops.bf16_panel_linear(x, panels, b, 70)
    for lo, hi in ((0, 1), (37, 101), (250, 300), (37, 300), (1, 299)):
        assert torch.equal(ops.bf16_panel_linear(x[lo:hi].contiguous(), panels, b, 70), whole[lo:hi]), (lo, hi)
    ref = x.bfloat16().double() @ w.bfloat16().double().T + b.double()
    bound = inp * 2.0**-24 * (x.abs().double() @ w.abs().double().T) + 1e-6
    assert torch.all((whole.double() - ref).abs() <= bound)
