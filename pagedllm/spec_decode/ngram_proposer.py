"""N-gram (prompt lookup) proposer: draft tokens copied from where the request's last few tokens occurred before.

Contract: `propose(tokens, k)` looks for the longest n-gram, `min_n <= n <= max_n`, that ends the token sequence and
also occurs earlier in it; among equally long matches the latest occurrence wins (the most recent context is the
likeliest to repeat: an edited line, a quoted passage). It returns up to `k` tokens that followed that occurrence,
fewer when the sequence ends first, and [] when nothing matches. Deterministic, so every tensor-parallel rank would
propose the same. The search runs natively where pagedllm._C is built (`ngram_propose`: one backward scan, a few
microseconds at 2048 tokens), else vectorised with numpy: one comparison over the sequence for the candidates that
end with the last token, then `max_n - 1` comparisons over those candidates only; no Python loop per token. Both
give the same drafts (tests/unit/test_ngram_proposer.py holds both to one brute force).
"""

from __future__ import annotations

import numpy as np
import torch  # noqa: F401  (pagedllm._C links against torch's libraries: they load first)

from pagedllm.config import SpeculativeConfig

try:
    from pagedllm._C import ngram_propose as _native_propose
except ImportError:  # not built, or built before it had the lookup: numpy's
    _native_propose = None


def native_available() -> bool:
    """Whether the native lookup is built (pagedllm._C)."""
    return _native_propose is not None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, native: bool | None = None) -> None:
        """native: the native lookup (True: required; None: where built; False: numpy's)."""
        if native and _native_propose is None:
            raise ValueError("native=True needs pagedllm._C built with ngram_propose: run `make setup`")
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.native = _native_propose is not None if native is None else native

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` [num_tokens] (int64), or []."""
        if self.native:
            return _native_propose(tokens, self.min_n, self.max_n, k)
        length = int(tokens.shape[0])
        if k <= 0 or length <= self.min_n:
            return []
        last = tokens[length - 1]
        # Candidates: positions e < length - 1 holding the last token, each the end of a possible earlier match
        # (with at least min_n - 1 tokens before it).
        ends = np.flatnonzero(tokens[: length - 1] == last)
        ends = ends[ends >= self.min_n - 1]
        if ends.size == 0:
            return []
        matched = np.ones(ends.size, dtype=np.int64)  # tokens matched so far, backwards from each end
        alive = np.ones(ends.size, dtype=bool)
        for d in range(1, min(self.max_n, length - 1)):
            ok = alive & (ends >= d)
            ok[ok] = tokens[ends[ok] - d] == tokens[length - 1 - d]
            matched += ok
            alive = ok
            if not alive.any():
                break
        best = int(matched.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest matches
        return tokens[end + 1 : end + 1 + k].tolist()
