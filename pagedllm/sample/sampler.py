"""The sampler: logits [num_reqs, vocab] + SamplingMetadata -> one token per row (+ logprobs).

Contract (vLLM V1 semantics):
- Logprobs are those of the RAW logits (before bias, penalties, temperature and filters), in float32.
  Each row holds the sampled token first, then the top-`max_num_logprobs` tokens; the caller slices
  each request's own number. Rank = 1 + number of vocab entries with a strictly greater logprob.
- Processing order: allowed_token_ids (every other id -inf) -> bad words (-inf for a word's last token where
  the output ends with the tokens before it) -> logit_bias -> min_tokens (forbid ids) -> repetition, frequency,
  presence penalties
  -> greedy rows take the argmax -> random rows: temperature, top-k, top-p, min-p, then sample.
- Random rows invert their cumulative distribution at one uniform U: the first token whose cumulative
  probability exceeds U times the row's total (an exact draw). A row without a seed takes U from the default
  RNG. A seeded row's U is a function of its seed and its draw index alone (`seeded_uniforms`, a counter-based
  generator), so a seeded request yields the same tokens whatever batch it is in, however many drafts are
  verified with it and after a preemption (filters break ties by token id, never by batch shape). The cumulative
  sums run in float64, natively in blocks on the CPU and in order in torch elsewhere: a U within rounding of a
  boundary between two tokens could pick the other one on another device or kernel build.
- Greedy rows' tokens never depend on randomness (a batch with an unseeded random row draws one default-RNG
  uniform for each of its rows). An all-greedy batch without bias, penalties or min_tokens is a plain argmax and
  consumes no randomness at all.
- The input logits are never modified. Everything is vectorised device-agnostic torch (the seeded uniforms are
  computed on the host, a few integer operations a row, and copied to the device), and the only host sync besides
  that copy is one small `.tolist()` per step when some row uses top-k (topk needs a Python int).
- With the native CPU ops (`Sampler(native)`), CPU rows go through one native call after the processing
  (csrc/cpu/sampling.cpp, `sample_rows`): each row read once, the logits not copied or modified, greedy rows'
  argmax, and for random rows temperature, top-k and top-p without a vocabulary sort, min-p and the inverse-CDF
  draw at the same U. It makes the torch path's choices but for rounding (its softmax is its own: a top-p cut or a
  U within rounding of a boundary may fall the other way); no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.engine.protocol import LogprobsLists
from pagedllm.sample.metadata import SamplingMetadata

# Same threshold as SamplingParams.greedy; metadata stores exactly 0.0 for greedy rows anyway.
_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs for a run of rows: the chosen token first, then the top-N, plus the chosen token's rank."""

    token_ids: torch.Tensor  # [num_rows, 1 + N] int64
    logprobs: torch.Tensor  # [num_rows, 1 + N] float32
    ranks: torch.Tensor  # [num_rows] int64, 1 = most likely

    def tolists(self) -> LogprobsLists:
        """Copy to the host as the wire struct (one device->host copy per tensor)."""
        return LogprobsLists(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
        )


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, and the logprobs when any row asked for them."""

    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None  # None when max_num_logprobs is None


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """From float32 logprobs [n, vocab]: the given tokens' logprobs, the top-N, and the tokens' ranks."""
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).view(-1, 1)
    token_logprobs = logprobs.gather(1, token_ids)
    # Ties with the chosen token do not push its rank down: only strictly greater entries count.
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    num_logprobs = min(num_logprobs, logprobs.shape[-1])
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        lps = torch.cat([token_logprobs, top_logprobs], dim=1)
    else:
        ids, lps = token_ids, token_logprobs
    return LogprobsTensors(token_ids=ids, logprobs=lps, ranks=ranks)


def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """log_softmax of raw logits [n, vocab] in float32; gather token_ids [n], the top-num_logprobs and ranks.

    Used for the sampled tokens and by the model runner for prompt_logprobs.
    """
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    return _gather_logprobs(logprobs, token_ids, num_logprobs)


class Sampler(torch.nn.Module):
    """Stateless: all per-request state (including RNG) arrives in the SamplingMetadata. `native`: the native CPU
    ops (pagedllm._C.CpuOps), whose `sample_rows` then serves CPU rows after the logit processing (None: torch
    throughout)."""

    def __init__(self, native: Any | None = None) -> None:
        super().__init__()
        self.native = native

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        num_logprobs = metadata.max_num_logprobs
        # Logprobs of the raw logits: vLLM reports the distribution before bias, penalties, temperature and filters.
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32) if num_logprobs is not None else None
        sampled = draw_tokens(logits, metadata, self.native)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def draw_tokens(logits: torch.Tensor, metadata: SamplingMetadata, native: Any | None = None) -> torch.Tensor:
    """[num_reqs] int64: each row's token from raw logits (not modified), as the module docstring says: bias,
    min_tokens and penalties on a float32 copy, then the argmax of greedy rows and a draw for random rows. `native`:
    as Sampler's (used for CPU rows)."""
    processing = needs_processing(metadata)
    if native is not None and logits.device.type == "cpu":
        work = (processed_logits(logits, metadata) if processing else logits.to(torch.float32)).contiguous()
        n = work.shape[0]
        u = (
            torch.zeros(n, dtype=torch.float64)
            if metadata.all_greedy
            else draw_uniforms(n, metadata.seeds, work.device)
        )
        out = torch.empty(n, dtype=torch.int64)

        def rows(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
            return None if t is None else t.to(dtype=dtype).contiguous()

        native.sample_rows(
            out, work, rows(metadata.temperature, torch.float32), rows(metadata.top_k, torch.int64),
            rows(metadata.top_p, torch.float32), rows(metadata.min_p, torch.float32), u,
        )  # fmt: skip
        return out
    if metadata.all_greedy and not processing:
        return logits.argmax(dim=-1)  # exact in the logits' own dtype: no float32 copy needed
    work = processed_logits(logits, metadata)
    greedy_sampled = None if metadata.all_random else work.argmax(dim=-1)
    if metadata.all_greedy:
        assert greedy_sampled is not None
        return greedy_sampled
    random_sampled = random_sample(sampling_probs(work, metadata), metadata.seeds)
    if greedy_sampled is None:
        return random_sampled
    return torch.where(greedy_rows(metadata), greedy_sampled, random_sampled)


def needs_processing(metadata: SamplingMetadata) -> bool:
    """Whether some row has a logit bias, min_tokens, a penalty, allowed ids or bad words (processed_logits then
    changes the logits)."""
    return (
        not metadata.no_penalties
        or bool(metadata.min_tokens)
        or bool(metadata.allowed_token_ids)
        or bool(metadata.bad_words)
        or any(b is not None for b in metadata.logit_bias)
    )


def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of the logits with bias, min_tokens and penalties applied (the caller's stay intact)."""
    work = logits.to(torch.float32, copy=True)
    if needs_processing(metadata):
        apply_allowed_token_ids(work, metadata)
        apply_bad_words(work, metadata)
        apply_logit_bias(work, metadata)
        apply_min_tokens(work, metadata)
        if not metadata.no_penalties:
            work = apply_penalties(work, metadata)
    return work


def greedy_rows(metadata: SamplingMetadata) -> torch.Tensor:
    """[num_reqs] bool: the rows that take the argmax."""
    return metadata.temperature < _GREEDY_EPS


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from, from processed logits (modified in place): temperature, top-k,
    top-p, softmax, then min-p, which zeroes tokens without renormalising. Greedy rows get temperature 1 (their
    row is only kept finite: the caller takes their argmax instead)."""
    temperature = metadata.temperature.to(logits.device)
    temperature = torch.where(temperature < _GREEDY_EPS, torch.ones_like(temperature), temperature)
    logits = logits.div_(temperature.unsqueeze(1))
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = torch.softmax(logits, dim=-1)
    if metadata.min_p is not None:
        max_probs = probs.amax(dim=-1, keepdim=True)
        # Renormalising is unnecessary: random_sample works on unnormalised weights.
        probs = probs.masked_fill(probs < metadata.min_p.to(logits.device).unsqueeze(1) * max_probs, 0.0)
    return probs


# --------------------------------------------------------------------------------------------------
# Logits processors, public so they can be tested (and reused) one by one. They run on a float32 copy.


def apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In each row with allowed_token_ids, every other id becomes -inf, in place."""
    for i, ids in metadata.allowed_token_ids.items():
        index = torch.tensor(ids, dtype=torch.int64, device=logits.device)
        kept = logits[i].index_select(0, index)
        logits[i].fill_(float("-inf"))
        logits[i].index_copy_(0, index, kept)


def apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """For each bad word of a row: its last token becomes -inf, in place, where the row's output ends with the
    word's tokens before it (always, for a one-token word)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, seqs in metadata.bad_words.items():
        output = metadata.output_token_ids[i]
        for seq in seqs:
            head = len(seq) - 1
            if head == 0 or (len(output) >= head and output[-head:] == seq[:-1]):
                rows.append(i)
                cols.append(seq[-1])
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Add each row's logit_bias to its logits, in place."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, bias in enumerate(metadata.logit_bias):
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            vals.extend(bias.values())
    if rows:
        dev = logits.device
        idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        # accumulate=True is a plain add (ids within a row are unique, being dict keys).
        logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Set the forbidden ids (eos, stop_token_ids) to -inf, in place, for rows still below min_tokens."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (min_toks, forbidden) in metadata.min_tokens.items():
        # Re-checked here so a metadata object built by hand is honoured the same way.
        if len(metadata.output_token_ids[i]) < min_toks:
            rows.extend([i] * len(forbidden))
            cols.extend(forbidden)
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens) penalties.

    Returns a new tensor. If `metadata.prompt_token_ids` is None, only output tokens count as seen. Returns the
    logits unchanged when no row has a penalty (`metadata.no_penalties`).
    """
    rep, freq, pres = metadata.repetition_penalties, metadata.frequency_penalties, metadata.presence_penalties
    if rep is None or freq is None or pres is None:
        return logits
    num_reqs, vocab = logits.shape
    dev = logits.device

    # Output-token counts per row, built from one flat host array and a single scatter-add (no per-row
    # device work).
    lengths = [len(t) for t in metadata.output_token_ids]
    total = sum(lengths)
    counts = torch.zeros((num_reqs, vocab), dtype=torch.float32, device=dev)
    if total:
        flat = np.fromiter((t for toks in metadata.output_token_ids for t in toks), dtype=np.int64, count=total)
        row_idx = np.repeat(np.arange(num_reqs, dtype=np.int64), lengths)
        counts.index_put_(
            (torch.from_numpy(row_idx).to(dev), torch.from_numpy(flat).to(dev)),
            torch.ones(total, dtype=torch.float32, device=dev),
            accumulate=True,
        )
    output_mask = counts > 0

    # Repetition penalty looks at prompt AND output tokens; the prompt padding id (vocab) lands in the
    # extra column, which is dropped.
    seen = output_mask
    if metadata.prompt_token_ids is not None and metadata.prompt_token_ids.numel():
        prompt_mask = torch.zeros((num_reqs, vocab + 1), dtype=torch.bool, device=dev)
        prompt_mask.scatter_(1, metadata.prompt_token_ids.to(dev), True)
        seen = seen | prompt_mask[:, :vocab]
    rep = rep.to(dev).unsqueeze(1)
    # HF/vLLM convention: shrink towards zero, i.e. divide positive logits and multiply negative ones.
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)

    freq = freq.to(dev).unsqueeze(1)
    pres = pres.to(dev).unsqueeze(1)
    return logits - freq * counts - pres * output_mask.to(torch.float32)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf, in place) everything outside each row's top-k set, then outside its top-p set.

    Both filters keep a prefix of the total order "logit descending, then token id ascending", i.e. what a
    stable descending sort gives. Ties are therefore resolved by token id, as argmax does (top_k=1 is
    exactly greedy), and never by batch-dependent kernel choices, so a seeded row behaves the same in any
    batch. Top-p keeps a token while the mass before it (a cumsum of the row's softmax in that order) is < p.
    A full vocab sort is only needed for top-p when some row in the batch has no top-k. (The native filters,
    csrc/cpu/sampling.cpp, keep the very same tokens given the same softmax: tests/model/test_sampling_kernels.py.)
    """
    if logits.shape[0] == 0:
        return logits
    vocab = logits.shape[-1]
    all_rows_top_k = False
    k_max = 0
    if top_k is not None:
        k = top_k.to(logits.device)
        active = k < vocab
        # One host sync per step (topk needs a Python int), never one per row.
        k_max, all_rows_top_k = torch.stack([k.masked_fill(~active, 0).max(), active.all()]).tolist()
        all_rows_top_k = bool(all_rows_top_k)
        if k_max > 0:
            _mask_outside_top_k(logits, k, active, k_max)
    if top_p is None:
        return logits

    p = top_p.to(device=logits.device, dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(logits, dim=-1)
    if all_rows_top_k:
        # Every row has at most k_max finite logits: only those candidates need ordering.
        cand_vals, cand_idx = logits.topk(k_max, dim=-1)
        # Order candidates by id, then stably by value, to get the same total order as a full stable sort.
        cand_idx, by_id = cand_idx.sort(dim=-1)
        cand_vals = cand_vals.gather(1, by_id)
        sorted_vals, order = cand_vals.sort(dim=-1, descending=True, stable=True)
        sorted_idx = cand_idx.gather(1, order)
        remove = _outside_top_p(probs.gather(1, sorted_idx), p)
        # Everything outside the candidates is already -inf, so rebuilding the row from them is exact.
        return logits.fill_(float("-inf")).scatter_(1, sorted_idx, sorted_vals.masked_fill(remove, float("-inf")))

    sorted_idx = logits.sort(dim=-1, descending=True, stable=True).indices
    remove = _outside_top_p(probs.gather(1, sorted_idx), p)
    # Undo the sort: scatter the sorted-order mask back to vocab order.
    remove = torch.empty_like(remove).scatter_(1, sorted_idx, remove)
    return logits.masked_fill_(remove, float("-inf"))


def _mask_outside_top_k(logits: torch.Tensor, k: torch.Tensor, active: torch.Tensor, k_max: int) -> None:
    """In place: keep the k largest logits of each active row (ties broken by lower token id)."""
    k = k.clamp(max=k_max)  # inactive rows (k = vocab) are clamped only to keep the gather in range
    kth = logits.topk(k_max, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    greater = logits > kth
    tied = logits == kth
    # Of the tokens tied with the k-th value, keep the lowest ids that still fit in k.
    room = k.unsqueeze(1) - greater.sum(dim=-1, keepdim=True)
    keep = greater | (tied & (tied.cumsum(dim=-1) <= room))
    logits.masked_fill_(~keep & active.unsqueeze(1), float("-inf"))


def _outside_top_p(sorted_probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Given the probabilities of a row's tokens in filter order [n, m] (the first m; softmax over the whole row)
    and top_p [n, 1], the sorted positions to drop."""
    # Keep a token while the mass strictly before it is < top_p: the smallest prefix reaching top_p. The
    # first token has 0 mass before it, so it is always kept. Rows with top_p == 1 are exempt because
    # float rounding could otherwise drop tail tokens.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Everything after the first token dropped is dropped too (a prefix, whatever the last bits of the probs).
    return ((mass_before >= p) & (p < 1.0)).cumsum(dim=-1) > 0


def draw_uniforms(n: int, seeds: dict[int, tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[n] float64 U in [0, 1): the row's `seeded_uniforms` value for a row in `seeds` (row -> (seed, draw index)),
    a uniform from the default RNG otherwise (one drawn for every row when any row lacks a seed)."""
    u = torch.empty(n, dtype=torch.float64, device=device)
    if len(seeds) < n:
        u.uniform_()
    if seeds:
        rows = sorted(seeds)
        values = torch.from_numpy(seeded_uniforms([seeds[r] for r in rows])).to(device)
        u.index_copy_(0, torch.tensor(rows, device=device), values)
    return u


def random_sample(probs: torch.Tensor, seeds: dict[int, tuple[int, int]]) -> torch.Tensor:
    """Sample one token per row from (unnormalised) probs: the first token whose cumulative probability, summed in
    float64, exceeds U times the row's total (U: `draw_uniforms`), never one without mass."""
    n, vocab = probs.shape
    u = draw_uniforms(n, seeds, probs.device)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    # u < total, but for rounding: never past the last token with mass (the first reaching the total).
    last = torch.searchsorted(cdf, total)
    return (
        torch.minimum(torch.searchsorted(cdf, u.unsqueeze(1).mul_(total), right=True), last)
        .squeeze(1)
        .clamp_(max=vocab - 1)
    )


_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: 2^64 / the golden ratio, odd


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function (a bijection of uint64 that mixes every bit into every other)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(draws: list[tuple[int, int]]) -> np.ndarray:
    """U in [0, 1) (float64, 53 random bits) for each (seed, draw index): output `index` of a splitmix64 stream
    whose state starts at the mixed seed. A counter-based generator: a draw depends on its seed and index alone,
    so a seeded request draws the same U for its t-th token whatever was drawn before or beside it, with nothing to
    keep or rewind between steps. Seeds are taken modulo 2^64."""
    seed = np.array([s & _MASK64 for s, _ in draws], dtype=np.uint64)
    index = np.array([i for _, i in draws], dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix64(_mix64(seed) + (index + np.uint64(1)) * _GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
