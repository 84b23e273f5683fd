"""Linear layers' fast paths (model/layers/linear.py): after `prepare_for_inference`, a layer gives F.linear's
result for every number of rows, whichever copy serves it (the native panels up to PANEL_MAX_ROWS rows, oneDNN's
packed weight beyond, or the plain weight), with and without the native ops given to the layers when built. The
panels are packed straight into one arena: exactly the reference layout, in a forward pass's order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers.embedding import ParallelLMHead
from pagedllm.model.layers.linear import (
    PANEL_MAX_ROWS,
    Panels,
    ReplicatedLinear,
    RowParallelLinear,
    prepare_for_inference,
)


def _layers(bias: bool, ops=None) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    g = torch.Generator().manual_seed(7)
    model = nn.Sequential(ReplicatedLinear(96, 70, bias=bias, ops=ops), ReplicatedLinear(70, 33, bias=bias, ops=ops))
    refs = []
    for layer in model:
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))
        refs.append((layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()))
    return model, refs


@pytest.mark.parametrize("bias", [False, True])
def test_native_layers_use_panels_and_match(isa_ops, bias: bool) -> None:
    calls = []

    class Spy:  # counts the rows each call to the panel kernel got
        def __getattr__(self, name):
            return getattr(isa_ops, name)

        def panel_linear(self, x, *args):
            calls.append(x.shape[0])
            return isa_ops.panel_linear(x, *args)

    model, refs = _layers(bias, Spy())
    prepare_for_inference(model)
    for layer in model:
        assert isinstance(layer.panels, Panels) and layer.panels.out_features == layer.output_size
    for rows in (1, 3, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 96)
        expected = x
        for w, b in refs:
            expected = F.linear(expected, w, b)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-5)
    assert calls == [1, 1, 3, 3, PANEL_MAX_ROWS, PANEL_MAX_ROWS]  # beyond that, oneDNN (or torch)


def test_row_parallel_bias_is_added_once(isa_ops) -> None:
    """One rank without adapters: the kernel adds the row-parallel layer's bias as it stores its sums (no pass of its
    own). A zero weight gives exactly the bias on every path (panels, oneDNN or torch beyond, and bf16 panels on the
    build that runs them), and a random one F.linear's result."""
    for bf16 in (False, True) if isa_ops.bf16_native() else (False,):
        _check_row_parallel_bias(isa_ops, bf16)


def _check_row_parallel_bias(isa_ops, bf16: bool) -> None:
    g = torch.Generator().manual_seed(3)
    layers = []
    for zero in (True, False):
        layer = RowParallelLinear(96, 70, bias=True, ops=isa_ops)
        layer.weight.data.copy_(torch.zeros(70, 96) if zero else torch.randn(70, 96, generator=g))
        layer.bias.data.copy_(torch.randn(70, generator=g))
        layers.append((layer, layer.weight.detach().clone(), layer.bias.detach().clone()))
        prepare_for_inference(layer, bf16=bf16)
    for rows in (1, PANEL_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 96, generator=g)
        (zero, _, b0), (layer, w, b) = layers
        assert torch.equal(zero(x), b0.expand(rows, -1))
        ref = F.linear(x.bfloat16().float(), w.bfloat16().float(), b) if bf16 else F.linear(x, w, b)
        torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-5)


def test_without_native_kernels_the_panels_are_not_built() -> None:
    model, refs = _layers(bias=True)
    prepare_for_inference(model)
    x = torch.randn(5, 96)
    expected = F.linear(F.linear(x, *refs[0]), *refs[1])
    for layer in model:
        assert layer.panels is None
    torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-5)


def _reference_panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """W [O, I] as [ceil(O / w), I, w]: panel p, input i, lane n holds W[p w + n][i], zero past O."""
    out, inp = w.shape
    padded = torch.zeros(-(-out // width) * width, inp)
    padded[:out] = w
    return padded.view(-1, width, inp).transpose(1, 2).contiguous()


def _odd_shapes(width: int) -> list[tuple[int, int]]:
    # [O, I]: one output, fewer outputs than a panel, one short of / one past / several whole panels, odd inputs; the
    # last ones large enough for the packing to be split over threads.
    return [(1, 1), (5, 3), (width - 1, 7), (width + 1, 96), (3 * width, 33), (1000, 301), (4 * width + 3, 1537)]


def test_pack_panels_into_out_is_the_reference_layout(isa_ops) -> None:
    width = isa_ops.panel_width()
    g = torch.Generator().manual_seed(3)
    for out, inp in _odd_shapes(width):
        w = torch.randn(out, inp, generator=g)
        expected = _reference_panels(w, width)
        assert torch.equal(isa_ops.pack_panels(w), expected)
        dst = torch.full(expected.shape, float("nan"))  # every element, padding included, must be written
        assert isa_ops.pack_panels(w, dst).data_ptr() == dst.data_ptr()
        assert torch.equal(dst, expected)


def test_pack_panels_refuses_a_bad_out(isa_ops) -> None:
    width = isa_ops.panel_width()
    w = torch.randn(2 * width + 1, 40)
    shape = (3, 40, width)
    buffer = torch.empty(w.numel() + 3 * 40 * width)
    for out, match in [
        (torch.empty(2, 40, width), "out panels must be"),
        (torch.empty(3, 41, width), "out panels must be"),
        (torch.empty(shape, dtype=torch.float64), "float32"),
        (torch.empty(3, width, 40).transpose(1, 2), "contiguous"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            isa_ops.pack_panels(w, out)
    weight = buffer[: w.numel()].view(w.shape)
    weight.copy_(w)
    with pytest.raises(RuntimeError, match="overlap"):
        isa_ops.pack_panels(weight, buffer[w.numel() - 40 :][: 3 * 40 * width].view(shape))
    isa_ops.pack_panels(weight, buffer[w.numel() :].view(shape))  # the same storage, apart: fine


def test_prepare_packs_the_panels_into_one_arena_in_forward_order(isa_ops) -> None:
    """Odd shapes, and an LM head first in module order: its panels still go last (it is read last)."""
    width = isa_ops.panel_width()
    g = torch.Generator().manual_seed(11)
    head = ParallelLMHead(4 * width + 5, 96, ops=isa_ops)
    linears = [ReplicatedLinear(inp, out, bias=True, ops=isa_ops) for out, inp in _odd_shapes(width)]
    model = nn.Sequential(head, *linears)
    for module in model:
        module.weight.data.copy_(torch.randn(module.weight.shape, generator=g))
    weights = [m.weight.detach().clone() for m in [*linears, head]]
    prepare_for_inference(model)
    panels = [m.panels for m in [*linears, head]]
    storage = panels[0].data.untyped_storage().data_ptr()
    end = None
    for p, w in zip(panels, weights, strict=True):
        assert isinstance(p, Panels) and p.out_features == w.shape[0]
        assert torch.equal(p.data, _reference_panels(w, width)) and p.data.is_contiguous()
        assert p.data.untyped_storage().data_ptr() == storage  # one arena
        start = p.data.data_ptr()
        assert start % 64 == 0 and (end is None or start == -(-end // 64) * 64)  # back to back, on cache lines
        end = start + p.data.numel() * p.data.element_size()
