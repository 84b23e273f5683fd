"""Rejection sampler: verify a request's draft tokens against the target model's logits at each draft position.

Contract. A request with drafts d_0 .. d_{k-1} has k + 1 consecutive rows of logits: row j is the distribution of
the token after d_{j-1} (row 0: after its last accepted token), processed exactly as the sampler processes a
single row (logit bias, min_tokens, penalties seeing the drafts before j as output tokens, temperature, top-k,
top-p, min-p: the metadata row of position j must say so). The result is the accepted drafts and one more token:
- greedy rows accept d_j while it is the argmax of row j, and then take row j's argmax, so the tokens are those
  plain greedy decoding gives;
- random rows accept d_j with probability p_j(d_j) and, at the first rejection, sample from p_j with d_j removed
  (renormalised). The drafts are deterministic (a point mass), so this is the standard speculative sampling rule
  and the tokens are distributed exactly as when sampled one at a time. When every draft is accepted, the last row
  gives one more token, sampled from p_k.
Random numbers come from the request's generator when it is seeded (one uniform per draft row, then the
exponential race's vocab_size uniforms per row), so a seeded request's output is reproducible.
A request without drafts has one row and gets the sampler's token.
"""

from __future__ import annotations

import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import (
    exponential_race,
    greedy_rows,
    needs_processing,
    processed_logits,
    sampling_probs,
)


class RejectionSampler:
    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: list[list[int]], starts: list[int]
    ) -> list[list[int]]:
        """logits [num_rows, vocab] (raw); metadata of the same rows; request i's drafts and its first row. Returns
        each request's tokens: its accepted drafts, then one token."""
        if metadata.all_greedy and not needs_processing(metadata):
            return _walk(logits.argmax(dim=-1).tolist(), None, drafts, starts)
        work = processed_logits(logits, metadata)
        greedy_target = None if metadata.all_random else work.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy_target is not None
            return _walk(greedy_target.tolist(), None, drafts, starts)

        num_rows, device = work.shape[0], work.device
        draft_of_row = torch.full((num_rows,), -1, dtype=torch.int64)  # -1: the row after the last draft
        for d, start in zip(drafts, starts):
            if d:
                draft_of_row[start : start + len(d)] = torch.tensor(d, dtype=torch.int64)
        draft_of_row = draft_of_row.to(device)
        has_draft = draft_of_row >= 0
        safe = draft_of_row.clamp(min=0).unsqueeze(1)

        probs = sampling_probs(work, metadata)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves the rows unnormalised
        p_draft = probs.gather(1, safe).squeeze(1)
        uniform = torch.rand(num_rows, device=device)
        for row, gen in metadata.generators.items():
            uniform[row] = torch.rand(1, generator=gen, device=device)
        accept = has_draft & (uniform < p_draft)
        # The distribution after a rejection: p without the rejected draft (the race needs no normalising).
        residual = probs.scatter(1, safe, torch.where(has_draft.unsqueeze(1), 0.0, p_draft.unsqueeze(1)))
        final = exponential_race(residual, metadata.generators)
        if greedy_target is not None:
            is_greedy = greedy_rows(metadata).to(device)
            accept = torch.where(is_greedy, has_draft & (draft_of_row == greedy_target), accept)
            final = torch.where(is_greedy, greedy_target, final)
        return _walk(final.tolist(), accept.tolist(), drafts, starts)


def _walk(final: list[int], accept: list[bool] | None, drafts: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Each request's accepted drafts (accept[row], or draft == final[row] when accept is None: greedy) and then the
    final token of its first rejected row, or of the row after its last draft."""
    out: list[list[int]] = []
    for d, start in zip(drafts, starts):
        tokens: list[int] = []
        for j, token in enumerate(d):
            ok = final[start + j] == token if accept is None else accept[start + j]
            if not ok:
                break
            tokens.append(token)
        tokens.append(final[start + len(tokens)])
        out.append(tokens)
    return out
