"""SamplingMetadata: one step's per-row sampling state, batched into tensors for the `Sampler`.

Contract:
- Row i of every field describes row i of the logits the sampler receives (one row per request).
- Tensors live on the device of the logits; per-row Python data (output tokens, logit bias, min_tokens, allowed
  token ids, bad words)
  stays on the host and is turned into index tensors by the sampler only when it is needed.
- Optional tensors are `None` when no row uses the feature, so the sampler can skip that work entirely (the
  three penalty tensors are None together, when `no_penalties`).
  When present, rows that do not use the feature hold a neutral value (top_k = vocab_size, top_p = 1.0,
  min_p = 0.0, penalties 0/0/1) so the batched op leaves them unchanged.
- Greedy rows have temperature exactly 0.0, neutral filters and no entry in `seeds`: their tokens never depend
  on randomness.
- `seeds` holds only random rows of requests with a seed: (the seed, the row's draw index). The draw index is
  the number of tokens the request has output before the one this row samples, so the t-th output token of a
  seeded request always comes from its t-th draw (sampler.seeded_uniforms), whatever its batch, its drafts or a
  preemption.
- `prompt_token_ids` is padded with `vocab_size`, so `vocab_size` must equal the logits' last dimension.

The model runner gets it each step from `InputBatch.sampling_metadata`, which slices per-row arrays kept
across steps. `from_requests` builds the same object from per-row Python data: the reference those slices are
tested against, and the way tests build a batch by hand. Both do one host->device copy per tensor and no
per-row device work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    """Batched sampling parameters for one forward step (see the module docstring for the contract)."""

    temperature: torch.Tensor  # [num_reqs] float32; 0.0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [num_reqs] int64; None when no row uses top-k
    top_p: torch.Tensor | None  # [num_reqs] float32; None when no row uses top-p
    min_p: torch.Tensor | None  # [num_reqs] float32; None when no row uses min-p
    seeds: dict[int, tuple[int, int]]  # row index -> (seed, draw index): random rows of seeded requests
    no_penalties: bool
    # [num_reqs] float32 each; None when no_penalties (no row uses any penalty)
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None  # [num_reqs, max_prompt_len] int64 padded with vocab_size
    output_token_ids: list[list[int]]  # per row: tokens generated so far
    min_tokens: dict[int, tuple[int, set[int]]]  # row -> (min_tokens, token ids forbidden until then)
    logit_bias: list[dict[int, float] | None]  # per row
    max_num_logprobs: int | None  # None when no row wants logprobs
    # row -> the only ids it may sample (allowed_token_ids), in range
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # row -> its bad words' token sequences (bad_words_token_ids)
    bad_words: dict[int, list[list[int]]] = field(default_factory=dict)

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device,
        draft_pos: list[int] | None = None,
    ) -> SamplingMetadata:
        """Batch per-row parameters; all lists are indexed by row and must have the same length. A row's seed is
        its params' `seed`, its draw index the length of its output tokens plus its `draft_pos` entry (as
        `InputBatch.sampling_metadata` has it)."""
        num_reqs = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(eos_token_ids) == num_reqs):
            raise ValueError("from_requests: all per-row lists must have the same length")

        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        seeds: dict[int, tuple[int, int]] = {}
        min_tokens: dict[int, tuple[int, set[int]]] = {}
        logit_bias: list[dict[int, float] | None] = []
        allowed: dict[int, list[int]] = {}
        bad_words: dict[int, list[list[int]]] = {}
        max_num_logprobs: int | None = None
        num_greedy = 0
        uses_top_k = uses_top_p = uses_min_p = False
        no_penalties = True

        for i, p in enumerate(params):
            if p.greedy:
                num_greedy += 1
                # Exactly 0 so the sampler can tell greedy rows apart; filters are neutral for them.
                temperature.append(0.0)
                top_k.append(vocab_size)
                top_p.append(1.0)
                min_p.append(0.0)
            else:
                temperature.append(p.temperature)
                k = vocab_size if p.top_k < 0 else min(p.top_k, vocab_size)
                uses_top_k |= k < vocab_size
                top_k.append(k)
                uses_top_p |= p.top_p < 1.0
                top_p.append(p.top_p)
                uses_min_p |= p.min_p > 0.0
                min_p.append(p.min_p)
                # Only random rows draw: a greedy row's seed is deliberately left out.
                if p.seed is not None:
                    seeds[i] = (p.seed, len(output_token_ids[i]) + (draft_pos[i] if draft_pos is not None else 0))

            presence.append(p.presence_penalty)
            frequency.append(p.frequency_penalty)
            repetition.append(p.repetition_penalty)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0:
                no_penalties = False

            if p.min_tokens > 0 and len(output_token_ids[i]) < p.min_tokens:
                forbidden = set(p.stop_token_ids or ())
                eos = eos_token_ids[i]
                if eos is not None and not p.ignore_eos:
                    forbidden.add(eos)
                # Out-of-range ids cannot be produced anyway; dropping them keeps the index op in bounds.
                forbidden = {t for t in forbidden if 0 <= t < vocab_size}
                if forbidden:
                    min_tokens[i] = (p.min_tokens, forbidden)

            bias = p.logit_bias
            if bias:
                # The front end should reject out-of-range ids; here they are dropped so a bad request
                # cannot crash the whole batch with an index error.
                bias = {t: b for t, b in bias.items() if 0 <= t < vocab_size} or None
            logit_bias.append(bias or None)
            if p.allowed_token_ids:
                allowed[i] = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
            if p.bad_words_token_ids:
                bad_words[i] = p.bad_words_token_ids

            if p.logprobs is not None:
                max_num_logprobs = p.logprobs if max_num_logprobs is None else max(max_num_logprobs, p.logprobs)

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        prompt_tensor: torch.Tensor | None = None
        if not no_penalties:
            # Built on the host with numpy (one copy per row) and moved to the device in one transfer.
            max_len = max((len(t) for t in prompt_token_ids), default=0)
            padded = np.full((num_reqs, max_len), vocab_size, dtype=np.int64)
            for i, toks in enumerate(prompt_token_ids):
                if toks:
                    padded[i, : len(toks)] = toks
            prompt_tensor = torch.from_numpy(padded).to(device)

        return cls(
            temperature=f32(temperature),
            all_greedy=num_greedy == num_reqs,
            all_random=num_greedy == 0,
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if uses_top_k else None,
            top_p=f32(top_p) if uses_top_p else None,
            min_p=f32(min_p) if uses_min_p else None,
            seeds=seeds,
            no_penalties=no_penalties,
            presence_penalties=None if no_penalties else f32(presence),
            frequency_penalties=None if no_penalties else f32(frequency),
            repetition_penalties=None if no_penalties else f32(repetition),
            prompt_token_ids=prompt_tensor,
            output_token_ids=output_token_ids,
            min_tokens=min_tokens,
            logit_bias=logit_bias,
            max_num_logprobs=max_num_logprobs,
            allowed_token_ids=allowed,
            bad_words=bad_words,
        )
