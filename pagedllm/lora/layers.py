"""The adapters' products inside a linear layer: y += (x A_s^T) B_s^T for each row's adapter slot s.

Contract. `LoRASlots(in_features, part_sizes, max_loras, max_rank, mapping)` gives a linear layer
(model/layers/linear.py LinearBase) room for `max_loras` adapters at once: A [S, R, in] and B transposed, [S, R, out],
of this rank's shapes, R = max_rank times the number of checkpoint matrices the layer merges (`part_sizes`: q, k, v
for qkv_proj; gate, up for gate_up_proj; one for the others). `assign(slot, {part: (a, b)})` writes an adapter's
pairs (`a` [r, in], `b` [out, r], as this rank holds them), `clear(slot)` empties a slot; `widths` [S] (int32) holds
each slot's columns in use. The parts of a slot sit back to back along R (each part's actual rank), so an adapter of
rank 8 under a maximum of 64 costs rank 8.

The layer path: the layer's forward calls `apply(x, y)`, which adds each slot's product to the rows `LoRAMapping`
assigns it this step (the model runner sets the mapping before the forward; rows of no adapter are left alone), in
place. A row-parallel layer adds it to its partial sum before the all-reduce: the shrink over this rank's input columns
is partial, and B is linear, so the reduced sum is the whole product. The fused decoder (csrc/cpu/decoder.cpp) reads
the same slots for its decode rows, in bf16 copies (`a16`, `b16`) where `fused_bf16` says so.
"""

from __future__ import annotations

import torch


class LoRAMapping:
    """The step's rows of each active adapter slot: [(slot, row index tensor)] (empty: no adapter this step)."""

    __slots__ = ("slots",)

    def __init__(self) -> None:
        self.slots: list[tuple[int, torch.Tensor]] = []


class LoRASlots:
    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        max_loras: int,
        max_rank: int,
        mapping: LoRAMapping,
        dtype: torch.dtype = torch.float32,
        fused_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.part_sizes = part_sizes  # this rank's output rows of each merged matrix
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        out = sum(part_sizes)
        width = max_rank * len(part_sizes)
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(
            max_loras, width, out, dtype=dtype, device=device
        )  # B^T: the fused decoder's axpy per rank column
        self.max_rank = max_rank
        self.used = [[0] * len(part_sizes) for _ in range(max_loras)]  # each slot's rank of each part
        self.widths = torch.zeros(max_loras, dtype=torch.int32)  # each slot's columns in use (the fused decoder's)
        # The fused decoder's copies (`fused_dtype`): bfloat16, or int8 with a float32 scale per row (a_scale,
        # b_scale [S, R]), beside bf16 or quantized base weights, where a decode step is bound by reading weights
        # and float32 adapters would add a third to it; float32: it reads a and b themselves.
        self.fused_dtype = fused_dtype
        copy = fused_dtype != torch.float32
        self.fa = torch.zeros(self.a.shape, dtype=fused_dtype) if copy else self.a
        self.fb = torch.zeros(self.b.shape, dtype=fused_dtype) if copy else self.b
        int8 = fused_dtype == torch.int8
        self.fa_scale = torch.zeros(max_loras, width) if int8 else torch.empty(0)
        self.fb_scale = torch.zeros(max_loras, width) if int8 else torch.empty(0)
        self.mapping = mapping

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.used[slot] = [0] * len(self.part_sizes)
        self.widths[slot] = 0
        if self.fused_dtype != torch.float32:
            self.fa[slot].zero_()
            self.fb[slot].zero_()

    def assign(self, slot: int, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` with an adapter's pairs by part: `a` [r, in] and `b` [part_size, r] (scaled), as this rank
        holds them; parts it leaves out stay zero."""
        self.clear(slot)
        col = 0
        for part in sorted(pairs):
            a, b = pairs[part]
            r = a.shape[0]
            if r > self.max_rank:
                raise ValueError(f"LoRA rank {r} above the maximum {self.max_rank}")
            if b.shape != (self.part_sizes[part], r) or a.shape[1] != self.a.shape[2]:
                raise ValueError(
                    f"LoRA pair A {tuple(a.shape)}, B {tuple(b.shape)} does not fit a layer part of "
                    f"{self.part_sizes[part]} x {self.a.shape[2]}"
                )
            self.a[slot, col : col + r] = a
            first = self.part_offsets[part]
            self.b[slot, col : col + r, first : first + self.part_sizes[part]] = b.t()
            self.used[slot][part] = r
            col += r
        self.widths[slot] = col
        if self.fused_dtype == torch.int8:
            for src, dst, scale in ((self.a, self.fa, self.fa_scale), (self.b, self.fb, self.fb_scale)):
                rows = src[slot]
                step = rows.abs().amax(dim=1) / 127
                step[step == 0] = 1.0
                dst[slot] = torch.round(rows / step[:, None]).clamp_(-127, 127).to(torch.int8)
                scale[slot] = step
        elif self.fused_dtype != torch.float32:
            self.fa[slot].copy_(self.a[slot])
            self.fb[slot].copy_(self.b[slot])

    def width(self, slot: int) -> int:
        return sum(self.used[slot])

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each mapped row's adapter product (x [M, in], y [M, out]); y itself when no row has one."""
        slots = self.mapping.slots
        if not slots:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        for slot, rows in slots:
            w = self.width(slot)
            if w == 0:
                continue
            a, bt = self.a[slot, :w], self.b[slot, :w]
            if rows.numel() == x2.shape[0]:
                y2.addmm_(x2 @ a.t(), bt)  # in place: the layer's own output, not a copy of it per adapter
            else:
                y2.index_add_(0, rows, (x2.index_select(0, rows) @ a.t()) @ bt)
        return y
