"""Huge-page-backed host tensors (pagedllm/model/hugepages.py): ordinary tensors whose large ones start on a 2 MiB
boundary on a Linux CPU, and `consolidate` moving parameters into one arena without changing a value.
Whether the kernel grants huge pages is its choice (THP may be off), so the tests check the layout we control and
the values, not the page size."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from pagedllm.model import hugepages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge-page advice is Linux-only")


@linux
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_large_tensors_start_on_a_huge_page(dtype: torch.dtype) -> None:
    t = hugepages.empty((3, 1 << 19), dtype)
    assert t.shape == (3, 1 << 19) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    z = hugepages.zeros((5, 300_000), dtype)
    assert z.data_ptr() % hugepages.HUGE_PAGE == 0 and not z.any()


def test_small_tensors_are_plain() -> None:
    t = hugepages.zeros((7, 3), torch.float32)
    assert t.shape == (7, 3) and not t.any()
    assert hugepages.empty((), torch.float32).shape == ()


@linux
def test_consolidate_keeps_values_and_rebinds_parameters() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(300, 257, bias=False), nn.Linear(257, 3000, bias=False), nn.Linear(13, 3, bias=False)]
    before = [layer.weight.detach().clone() for layer in layers]
    x = torch.randn(2, 300)
    expected = layers[1](layers[0](x))
    arena = hugepages.consolidate([layer.weight for layer in layers])  # ~3.4 MB
    assert arena is not None and arena.data_ptr() % hugepages.HUGE_PAGE == 0
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer.weight, old) and layer.weight.is_contiguous()
        assert layer.weight.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        assert layer.weight.data_ptr() % 64 == 0  # each weight starts on a cache line
    ptrs = [layer.weight.data_ptr() for layer in layers]
    assert ptrs == sorted(ptrs)  # in the order given
    torch.testing.assert_close(layers[1](layers[0](x)), expected, atol=0, rtol=0)


def test_consolidate_refuses_mixed_dtypes() -> None:
    params = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4, dtype=torch.float64))]
    if not hugepages.applies("cpu"):
        assert hugepages.consolidate(params) is None
        return
    with pytest.raises(ValueError, match="one dtype"):
        hugepages.consolidate(params)


@linux
def test_large_tensors_are_private_mappings() -> None:
    """Shared anonymous memory (Python's mmap default) is shmem, which transparent huge pages do not back: the
    mapping must be private."""
    t = hugepages.zeros((4, 1 << 20), torch.float32)
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                assert perms.endswith("p"), line
                return
    raise AssertionError("the tensor's mapping is not in /proc/self/maps")
