"""sample/grammar_mask.py: the native bitmask op and numpy's give the logits a brute-force reading of the bits gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample import grammar_mask
from pagedllm.sample.grammar_mask import apply_token_bitmask


def _bitmask(rng: np.random.Generator, n: int, words: int) -> np.ndarray:
    """Rows like a JSON grammar's: inside a string (nearly all ones), a key or number (a few bits), mixed words."""
    out = np.zeros((n, words), dtype=np.uint32)
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out[i] = 0xFFFFFFFF
            out[i, rng.integers(0, words, 4)] = rng.integers(0, 2**32, 4, dtype=np.uint32)
        elif kind == 1:
            out[i, rng.integers(0, words, 3)] = np.uint32(1) << rng.integers(0, 32, 3).astype(np.uint32)
        else:
            out[i] = rng.integers(0, 2**32, words, dtype=np.uint32)
    return out.view(np.int32)


def _reference(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.view(np.uint32)
    for i, r in enumerate(rows):
        for t in range(out.shape[1]):
            w = t // 32
            if w >= words.shape[1] or not (int(words[i, w]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize(
    "vocab, words, rows",
    [
        (1000, 32, [0, 1, 2, 3, 4]),  # vocab not a multiple of 32; the last word's high bits past it
        (1000, 30, [4, 0, 2]),  # a padded vocabulary: tokens past the bitmask are never allowed; rows out of order
        (993, 40, [1]),  # a bitmask wider than the logits
    ],
)
@pytest.mark.parametrize("native", [False, True])
def test_matches_brute_force(vocab: int, words: int, rows: list[int], native: bool) -> None:
    if native and not grammar_mask.native_available():
        pytest.fail("pagedllm._C has no apply_token_bitmask: run `make setup`")
    rng = np.random.default_rng(vocab + words)
    logits = torch.randn(5, vocab)
    bitmask = _bitmask(rng, len(rows), words)
    expected = _reference(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows, native=native)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_native_matches_numpy_at_a_real_vocabulary() -> None:
    if not grammar_mask.native_available():
        pytest.fail("pagedllm._C has no apply_token_bitmask: run `make setup`")
    rng = np.random.default_rng(0)
    vocab = 49152 + 7
    bitmask = _bitmask(rng, 13, (vocab + 31) // 32)
    rows = list(rng.permutation(16)[:13])
    base = torch.randn(16, vocab)
    a, b = base.clone(), base.clone()
    apply_token_bitmask(a, bitmask, rows, native=True)
    apply_token_bitmask(b, bitmask, rows, native=False)
    assert torch.equal(a, b)
    untouched = sorted(set(range(16)) - set(rows))
    assert torch.equal(a[untouched], base[untouched])


def test_bad_rows_are_refused() -> None:
    logits = torch.zeros(2, 64)
    bitmask = np.full((1, 2), -1, dtype=np.int32)
    with pytest.raises(ValueError, match="1 bitmask rows"):
        apply_token_bitmask(logits, bitmask, [0, 1])
    if grammar_mask.native_available():
        with pytest.raises(RuntimeError, match="outside"):
            apply_token_bitmask(logits, bitmask, [2], native=True)
