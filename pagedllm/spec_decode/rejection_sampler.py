"""Rejection sampler: verify a request's draft tokens against the target model's logits at each draft position.

Contract. A request with drafts d_0 .. d_{k-1} has k + 1 consecutive rows of logits: row j is the distribution of
the token after d_{j-1} (row 0: after its last accepted token), processed exactly as the sampler processes a
single row (logit bias, min_tokens, penalties seeing the drafts before j as output tokens, temperature, top-k,
top-p, min-p: the metadata row of position j must say so). The result is the accepted drafts and one more token.

The rule. Each row j draws the token the sampler would draw there: the argmax for a greedy row, else one
exact draw from p_j (the sampler's `draw_tokens`: inverse CDF at one uniform). d_j is accepted
when it equals that token; at the first row where it does not, that token is output and the rest are dropped; when
every draft is accepted, the last row's token follows them. For a draft that is a point mass, as an n-gram draft
is, this is the standard speculative-sampling rule (accept d with probability p(d), else sample from p with d
removed, renormalised): the draw picks d with probability p(d), and conditioned on not picking it, its token is
distributed as p without d. So the output is distributed exactly as sampling one token at a time, and greedy rows
give exactly the greedy tokens.
Seeded requests: row j of a request's rows has draw index (its output tokens so far) + j in `metadata.seeds`, so
the row that outputs its t-th token draws with index t, as plain decoding would (a counter-based generator,
sampler.seeded_uniforms: nothing to rewind after a rejection). Its output is the same with drafts as without,
however many drafts were proposed.
A request without drafts has one row and gets the sampler's token.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import draw_tokens


class RejectionSampler:
    def __init__(self, native: Any | None = None) -> None:
        self.native = native  # as Sampler's: the native CPU ops for CPU rows, or None

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]], starts: list[int]
    ) -> list[list[int]]:
        """logits [num_rows, vocab] (raw); metadata of the same rows (a seeded row's draw index counting the
        drafts before it); request i's drafts and its first row. Returns each request's tokens: its accepted
        drafts, then one token."""
        return _walk(draw_tokens(logits, metadata, self.native).tolist(), drafts, starts)


def _walk(sampled: list[int], drafts: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Each request's drafts while they equal the row's sampled token, then the sampled token of the first row where
    the draft differs, or of the row after its last draft."""
    out: list[list[int]] = []
    for d, start in zip(drafts, starts):
        tokens: list[int] = []
        for j, token in enumerate(d):
            if sampled[start + j] != token:
                break
            tokens.append(token)
        tokens.append(sampled[start + len(tokens)])
        out.append(tokens)
    return out
