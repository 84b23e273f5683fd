"""Structured output's mask on the logits: -inf for every token a grammar bitmask row does not allow.

Contract. `apply_token_bitmask(logits, bitmask, rows)` sets `logits[rows[i], t] = -inf` for every token t whose bit in
`bitmask[i]` is 0 (bit `t % 32` of int32 word `t // 32`, least significant first, llguidance's layout), and for every
token at or past the bitmask's `32 * words` (a vocabulary padded beyond the tokenizer's). `logits` is float32
[num_rows, vocab], changed in place; `bitmask` int32 [n, words] (numpy); `rows` the n logits rows, distinct. On the
CPU the native op (pagedllm._C `apply_token_bitmask`: a word of all ones skipped, one of zeros filled, rows split
between threads) does it with no temporary; elsewhere, or where the extension is not built, numpy unpacks the bits
into a boolean mask moved to the logits' device. Both give the same logits (tests/unit/test_grammar_mask.py).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from pagedllm._C import apply_token_bitmask as _native_apply
except ImportError:  # not built, or built before it had the op: numpy's
    _native_apply = None


def native_available() -> bool:
    """Whether the native op is built (pagedllm._C)."""
    return _native_apply is not None


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int], native: bool | None = None) -> None:
    """-inf in `logits` row `rows[i]` wherever `bitmask[i]` has a 0 bit (and past its last word). native: the native
    op (None: where built and the logits are float32 on the CPU; False: numpy's)."""
    if len(rows) != bitmask.shape[0]:
        raise ValueError(f"{len(rows)} logits rows for {bitmask.shape[0]} bitmask rows")
    if not rows:
        return
    if native is None:
        native = _native_apply is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
    if native:
        if _native_apply is None:
            raise ValueError("native=True needs pagedllm._C built with apply_token_bitmask: run `make setup`")
        _native_apply(logits, np.ascontiguousarray(bitmask, dtype=np.int32), np.asarray(rows, dtype=np.int64))
        return
    vocab = logits.shape[1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype=np.int32).view(np.uint8), axis=1, bitorder="little")
    disallowed = np.ones((len(rows), vocab), dtype=np.bool_)  # tokens past the bitmask's words too
    width = min(vocab, bits.shape[1])
    np.logical_not(bits[:, :width], out=disallowed[:, :width])
    mask = torch.from_numpy(disallowed).to(logits.device, non_blocking=True)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(mask, float("-inf"))  # every row is masked, in order
    else:
        index = torch.as_tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(mask, float("-inf"))
