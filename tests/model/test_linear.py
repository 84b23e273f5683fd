"""Linear layers' fast paths (model/layers/linear.py): after `prepare_for_inference`, a layer gives F.linear's
result for every number of rows, whichever copy serves it (the native panels up to PANEL_MAX_ROWS rows, oneDNN's
packed weight beyond, or the plain weight), with and without the native ops given to the layers when built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers.linear import PANEL_MAX_ROWS, Panels, ReplicatedLinear, prepare_for_inference


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


def test_without_native_kernels_the_panels_are_not_built() -> None:
    model, refs = _layers(bias=True)
    prepare_for_inference(model)
    x = torch.randn(5, 96)
    expected = F.linear(F.linear(x, *refs[0]), *refs[1])
    for layer in model:
        assert layer.panels is None
    torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-5)
