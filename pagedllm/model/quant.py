"""GGUF block-quantized tensors as the loader hands them to the layers, and what the layers build from them.

Contract.
* `QuantTensor(qtype, data, shape)`: a weight [rows, cols] in a GGML block format, `data` its file bytes as uint8
  [rows, row_bytes] (a view of the mapped file until the layer copies it). It travels through the layers' weight
  loaders like a float tensor: `.to(dtype)` / `.to(device)` return it unchanged (the dtype applies once it is
  de-quantized), `narrow(0, ...)` and `index_rows` select whole rows exactly, `narrow(1, ...)` selects whole blocks
  and otherwise returns the de-quantized float32 slice, and `dequantize()` gives float32 through the `gguf`
  package's reference.
* `NATIVE_TYPES`: the GGML types the native kernels run as stored (csrc/cpu/quant.cpp). A layer keeps a weight
  quantized when the model loads with quantization on, the native ops are there, and `ops.quant_row_bytes` accepts
  the type and row length. `HALF_TYPES` (F16, BF16) reach the layers as QuantTensors too: linears run them on bf16
  panels (F16 rounded to bf16, which the loader logs), embeddings keep them as stored. A GGUF weight of any other
  type is refused by the loader (loader.py), naming the tensor and the type.
* `QuantParts`: the row segments one layer collects (a merged q|k|v takes three), turned by `build(ops)` into the
  kernels' `QuantMatrix` over one owned copy of the bytes in huge-page memory; the mapped file is not referenced
  afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.model import hugepages

# GGML type ids (gguf.GGMLQuantizationType) with a native kernel.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23
MXFP4 = 39  # gpt-oss's experts
NATIVE_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)
# Float types a GGUF file may hold a weight in: float32 runs as float32, float16 and bfloat16 on bf16 panels.
F32, F16, BF16 = 0, 1, 30
HALF_TYPES = (F16, BF16)


def type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def block_size(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block of the type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


class QuantTensor:
    """A [rows, cols] weight in GGML type `qtype`; `data` uint8 [rows, row_bytes]."""

    def __init__(self, qtype: int, data: torch.Tensor, shape: tuple[int, int]) -> None:
        weights, nbytes = block_size(qtype)
        rows, cols = shape
        if cols % weights or tuple(data.shape) != (rows, cols // weights * nbytes) or data.dtype != torch.uint8:
            raise ValueError(
                f"a {type_name(qtype)} tensor of shape {shape} needs uint8 data [{rows}, {cols // weights * nbytes}]"
                f", got {data.dtype} {tuple(data.shape)}"
            )
        self.qtype = int(qtype)
        self.data = data
        self.shape = torch.Size(shape)

    def __repr__(self) -> str:
        return f"QuantTensor({type_name(self.qtype)}, shape={tuple(self.shape)})"

    @property
    def dtype(self) -> str:
        return type_name(self.qtype)

    def to(self, *args: Any, **kwargs: Any) -> QuantTensor:
        """Itself: a quantized tensor keeps its type until it is de-quantized (and stays on the CPU)."""
        return self

    @property
    def is_half(self) -> bool:
        """Whether this is a float16 or bfloat16 tensor (run on bf16 panels, not by the block kernels)."""
        return self.qtype in HALF_TYPES

    def half(self) -> torch.Tensor:
        """A float16 or bfloat16 tensor as stored: a view of its bytes [rows, cols]."""
        dtype = torch.float16 if self.qtype == F16 else torch.bfloat16
        return self.data.contiguous().view(dtype).reshape(tuple(self.shape))

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] through the gguf package's reference de-quantization."""
        if self.is_half:
            return self.half().float()
        import gguf

        w = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(tuple(self.shape)))

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor | torch.Tensor:
        """Rows (dim 0), or columns (dim 1) on block boundaries, still quantized; other columns de-quantized."""
        if dim == 0:
            return QuantTensor(self.qtype, self.data.narrow(0, start, length), (length, self.shape[1]))
        weights, nbytes = block_size(self.qtype)
        if dim == 1 and start % weights == 0 and length % weights == 0:
            part = self.data.narrow(1, start // weights * nbytes, length // weights * nbytes).contiguous()
            return QuantTensor(self.qtype, part, (self.shape[0], length))
        return self.dequantize().narrow(dim, start, length)

    def index_rows(self, index: np.ndarray | torch.Tensor) -> QuantTensor:
        """The rows `index` (a permutation or selection), still quantized."""
        index = torch.as_tensor(index, dtype=torch.long)
        return QuantTensor(self.qtype, self.data[index], (int(index.numel()), self.shape[1]))

    def __getitem__(self, rows: slice) -> QuantTensor:
        """Whole rows by a slice (what the vocabulary shard of an embedding takes)."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a QuantTensor selects rows with a plain slice only")
        start, stop, _ = rows.indices(self.shape[0])
        return self.narrow(0, start, max(0, stop - start))


class QuantParts:
    """The quantized row segments of one layer's weight [out_features, in_features], by first output row."""

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features = out_features
        self.in_features = in_features
        self.parts: dict[int, QuantTensor] = {}

    def add(self, first_row: int, tensor: QuantTensor) -> None:
        self.parts[first_row] = tensor

    def complete(self) -> bool:
        """Whether the segments cover every output row exactly once, in order."""
        row = 0
        for first in sorted(self.parts):
            if first != row:
                return False
            row += self.parts[first].shape[0]
        return row == self.out_features

    def dequantize_into(self, weight: torch.Tensor) -> None:
        """Write the segments de-quantized into the float weight (a layer that cannot run them as stored)."""
        for first, part in self.parts.items():
            weight.narrow(0, first, part.shape[0]).copy_(part.dequantize())
        self.parts.clear()

    def segments(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The segments in row order, adjacent ones of one type merged: (type, their byte tensors)."""
        merged: list[tuple[int, list[torch.Tensor]]] = []
        for first in sorted(self.parts):
            part = self.parts[first]
            if merged and merged[-1][0] == part.qtype:
                merged[-1][1].append(part.data)
            else:
                merged.append((part.qtype, [part.data]))
        return merged

    def shapes(self) -> list[tuple[int, int]]:
        """The byte shapes [rows, row_bytes] of `segments()`: what `build` needs room for."""
        return [(sum(t.shape[0] for t in ts), ts[0].shape[1]) for _, ts in self.segments()]

    def build(self, ops: Any, out: list[torch.Tensor] | None = None) -> Any:
        """The kernels' QuantMatrix over one owned copy of the segments' bytes, written into `out` when given
        (uint8 tensors of `shapes()`, e.g. views of the model's huge-page arena), else into a new allocation. The
        segments are dropped: the mapped file is no longer referenced."""
        segments = self.segments()
        if out is None:
            _, out = hugepages.arena(self.shapes(), torch.uint8)
        # The matrix's bytes, for its layer to keep (`qweight_bytes`): the kernels read them through raw pointers,
        # and sleep mode (worker/sleep.py) finds a weight's memory through the tensors its layer holds.
        self.packed = list(out)
        for view, (_, ts) in zip(out, segments, strict=True):
            torch.cat(ts, out=view) if len(ts) > 1 else view.copy_(ts[0])
        self.parts.clear()
        return ops.quant_matrix([qtype for qtype, _ in segments], list(out), self.in_features)


def keeps(ops: Any, tensor: QuantTensor, in_features: int) -> bool:
    """Whether native ops run `tensor` (a weight whose rows are `in_features` long) as stored."""
    return ops is not None and tensor.shape[1] == in_features and ops.quant_row_bytes(tensor.qtype, in_features) > 0
