"""Unit tests for NgramProposer (prompt lookup): what `propose(tokens, k)` returns.

Checks, on hand-made sequences, that the longest n-gram (min_n..max_n) ending the sequence wins over a later shorter
one, that the latest of equally long earlier occurrences wins, that a match shorter than min_n gives [], that k caps
the draft and fewer tokens come back near the end of the sequence, and that no match (or k <= 0, or too short a
sequence) gives []. Then compares it with a plain-Python brute force written here, over many random sequences from a
small vocabulary (fixed seed, so matches are frequent) and over int64 arrays of a few thousand tokens. Every test runs
on both implementations: numpy's and the native lookup (pagedllm._C.ngram_propose, which the engine uses where built).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer, native_available

NATIVE = None  # set by the `impl` fixture: True for the native lookup, False for numpy's


@pytest.fixture(autouse=True, params=["numpy", "native"])
def impl(request):
    global NATIVE
    if request.param == "native" and not native_available():
        pytest.skip("pagedllm._C is not built (make setup)")
    NATIVE = request.param == "native"
    yield request.param
    NATIVE = None


def proposer(min_n: int, max_n: int) -> NgramProposer:
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    prop = NgramProposer(config, native=NATIVE)
    assert prop.native is NATIVE
    return prop


def propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    return proposer(min_n, max_n).propose(np.array(tokens, dtype=np.int64), k)


def test_the_engine_uses_the_native_lookup_where_built(impl: str) -> None:
    """A built pagedllm._C has the lookup (a build older than it would fail here), and the default proposer uses it."""
    try:
        import pagedllm._C as C
    except ImportError:
        pytest.skip("pagedllm._C is not built (make setup)")
    assert hasattr(C, "ngram_propose")
    assert NgramProposer(SpeculativeConfig(num_speculative_tokens=4)).native


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The contract, literally: for n from max_n down to min_n, the latest earlier occurrence of the last n tokens
    (ending before the last token; overlaps allowed) gives the up to k tokens after it."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue  # an earlier occurrence ends at length - 2 at the latest, so needs n <= length - 1
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):  # latest first
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


# ------------------------------------------------------------------------------------------------
# Hand-made cases


def test_longest_match_wins_over_a_later_shorter_one() -> None:
    # Suffix (2, 3, 4): occurs in full at the start (followed by 10, 11); only (3, 4) occurs later (followed by 20).
    tokens = [2, 3, 4, 10, 11, 7, 3, 4, 20, 21, 2, 3, 4]
    assert propose(tokens, 2, min_n=2, max_n=3) == [10, 11]
    # With the window capped at 2 tokens, the latest 2-gram wins instead.
    assert propose(tokens, 2, min_n=2, max_n=2) == [20, 21]
    # A 1-token window: the latest earlier 4 is the one before 20.
    assert propose(tokens, 1, min_n=1, max_n=1) == [20]


def test_latest_of_equally_long_matches_wins() -> None:
    tokens = [5, 6, 1, 9, 5, 6, 2, 8, 5, 6]
    # (5, 6) occurs ending at 1 and at 5: the latest (followed by 2, 8) wins.
    assert propose(tokens, 2, min_n=2, max_n=2) == [2, 8]
    assert propose(tokens, 2, min_n=1, max_n=4) == [2, 8]


def test_min_n_is_respected() -> None:
    tokens = [1, 2, 3, 9, 8, 7, 2, 3]
    assert propose(tokens, 3, min_n=2, max_n=4) == [9, 8, 7]
    # Only a 2-token match exists: a window of at least 3 finds nothing.
    assert propose(tokens, 3, min_n=3, max_n=4) == []


def test_k_caps_the_draft_and_the_end_of_the_sequence_shortens_it() -> None:
    tokens = [4, 5, 30, 31, 32, 33, 34, 4, 5]
    assert propose(tokens, 3, min_n=2, max_n=2) == [30, 31, 32]
    assert propose(tokens, 1, min_n=2, max_n=2) == [30]
    assert propose(tokens, 100, min_n=2, max_n=2) == [30, 31, 32, 33, 34, 4, 5]
    # Overlapping match close to the end: (1, 1) last occurs earlier ending at index 2, with one token after it.
    assert propose([1, 1, 1, 1], 5, min_n=2, max_n=3) == [1]
    assert propose([7, 8, 7, 8], 5, min_n=2, max_n=2) == [7, 8]


def test_no_match_gives_empty() -> None:
    assert propose(list(range(20)), 4, min_n=1, max_n=5) == []
    # The last token occurs earlier, but not the 2 tokens ending the sequence.
    assert propose([1, 2, 3, 4, 3], 4, min_n=2, max_n=5) == []
    # Too short to hold a min_n-gram twice, and k <= 0.
    assert propose([3, 3], 4, min_n=2, max_n=5) == []
    assert propose([3, 3, 3], 0, min_n=1, max_n=2) == []
    assert propose([], 4, min_n=1, max_n=2) == []


def test_returns_python_ints() -> None:
    out = propose([9, 1, 2, 9, 1], 2, min_n=1, max_n=3)
    assert out == [2, 9]
    assert all(type(t) is int for t in out)


# ------------------------------------------------------------------------------------------------
# Against the brute force


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 2), (2, 4), (3, 5), (5, 5)])
def test_matches_brute_force_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(1000 * min_n + max_n)
    prop = proposer(min_n, max_n)
    found = empty = longest_not_latest = 0
    for _ in range(400):
        vocab = int(rng.integers(2, 5))
        length = int(rng.integers(1, 50))
        tokens = rng.integers(0, vocab, size=length).astype(np.int64)
        k = int(rng.integers(0, 7))
        as_list = tokens.tolist()
        want = brute_force(as_list, k, min_n, max_n)
        assert prop.propose(tokens, k) == want, (as_list, k)
        if want:
            found += 1
            # Would a rule taking the latest min_n-gram match (ignoring length) differ here?
            if brute_force(as_list, k, min_n, min_n) != want:
                longest_not_latest += 1
        elif k > 0:
            empty += 1
    # The random cases exercise matches, misses, and (with a window) the longest-over-latest preference.
    assert found > 40 and empty > 15
    if max_n > min_n:
        assert longest_not_latest > 5


@pytest.mark.parametrize("vocab,min_n,max_n", [(4, 2, 5), (3, 3, 4), (50, 1, 3)])
def test_matches_brute_force_on_long_int64_sequences(vocab: int, min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(vocab)
    tokens = rng.integers(0, vocab, size=4000).astype(np.int64)
    prop = proposer(min_n, max_n)
    as_list = tokens.tolist()
    nonempty = 0
    for length in [4000, 3999, 3001, 2500, 1234, 700, 64]:
        for k in (1, 4, 9):
            want = brute_force(as_list[:length], k, min_n, max_n)
            got = prop.propose(tokens[:length], k)
            assert got == want, (length, k)
            nonempty += bool(want)
    assert nonempty > 0
    # A long repeat: the second copy of a random block is drafted from the first (with a vocabulary this small the
    # latest match may be elsewhere, which the brute force decides).
    block = rng.integers(0, vocab, size=1500).astype(np.int64)
    seq = np.concatenate([block, rng.integers(0, vocab, size=300), block[:900]]).astype(np.int64)
    got = prop.propose(seq, 6)
    assert got == brute_force(seq.tolist(), 6, min_n, max_n)
    if vocab >= 50:
        assert got == block[900:906].tolist()
