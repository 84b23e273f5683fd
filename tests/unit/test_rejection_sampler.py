"""Unit tests for the RejectionSampler: which tokens a verification of draft tokens outputs, and their distribution.

* Greedy rows: drafts are accepted while they equal the row's argmax, then the argmax of the first mismatching row
  (or of the row after the last draft) follows; requests without drafts get their row's argmax; several requests
  with different numbers of drafts share one call (their `starts`); bias, and greedy rows mixed with random ones.
* Random rows, by a chi-square test on many requests verified in one batched call: the first output token is
  distributed as p (the first row's softmax) whatever the draft, the token after an accepted draft as the next row's
  distribution, and the output length as the acceptance probabilities say. The same statistic rejects two broken
  rules computed here (always accept the draft; resample from p without removing the draft), so it can fail.
* Seeded requests: the same tokens on every call, equal to plain one-token-at-a-time sampling with the same seed (row
  j of a request draws at its output position, as the model runner numbers it).
* Temperature with top-k / top-p: no token outside the kept set is ever output, accepted or sampled.
Every test runs on the sampler's torch path, then with the native CPU kernels (tests/unit/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection_sampler import RejectionSampler

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
NATIVE = None  # the native CPU ops of the running case, or None (the torch path): tests/unit/conftest.py
pytestmark = pytest.mark.usefixtures("sampler_backend")


def rejection_sampler() -> RejectionSampler:
    return RejectionSampler(NATIVE)


# Upper 0.999 quantiles of the chi-square distribution by degrees of freedom, from standard statistical tables
# (scipy.stats.chi2.ppf(0.999, df)); a correct sampler exceeds them with probability 0.001 (and the seeds are fixed).
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def metadata(params: list[SamplingParams], vocab: int, positions: list[int] | None = None) -> SamplingMetadata:
    """Rows of `params`; a seeded row's draw index is its entry of `positions` (its output position)."""
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompt_token_ids=[[0] for _ in range(n)],
        output_token_ids=[[] for _ in range(n)],
        eos_token_ids=[None] * n,
        vocab_size=vocab,
        device=CPU,
        draft_pos=positions,
    )


def layout(drafts: list[list[int]]) -> list[int]:
    """Each request's first row: a request has one row per draft plus one."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    return starts


def logits_with_argmax(argmax: list[int], vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax), vocab, generator=g)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probabilities (over the categories with p > 0), and its degrees
    of freedom. A category with p = 0 that was observed makes the statistic infinite."""
    counts = counts.double()
    probs = probs.double()
    if (counts[probs == 0] > 0).any():
        return float("inf"), int((probs > 0).sum()) - 1
    keep = probs > 0
    expected = counts.sum() * probs[keep] / probs[keep].sum()
    assert expected.min() >= 5, "too few trials for the chi-square approximation"
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def assert_distributed_as(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi_square(torch.bincount(tokens, minlength=probs.numel()), probs)
    assert stat < CHI2_999[df], (stat, df)


def assert_not_distributed_as(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi_square(torch.bincount(tokens, minlength=probs.numel()), probs)
    assert stat > CHI2_999[df], (stat, df)


# ------------------------------------------------------------------------------------------------
# Greedy


def test_greedy_all_drafts_accepted_gets_k_plus_one_tokens() -> None:
    argmax = [3, 1, 4, 1, 5]
    logits = logits_with_argmax(argmax, 8)
    out = rejection_sampler()(logits, metadata([GREEDY] * 5, 8), [argmax[:4]], [0])
    assert out == [argmax]


def test_greedy_mismatch_at_position_j() -> None:
    argmax = [3, 1, 4, 1, 5]
    vocab = 8
    logits = logits_with_argmax(argmax, vocab)
    for j in range(4):
        drafts = list(argmax[:4])
        drafts[j] = (argmax[j] + 1) % vocab
        out = rejection_sampler()(logits, metadata([GREEDY] * 5, vocab), [drafts], [0])
        assert out == [argmax[:j] + [argmax[j]]], j


def test_greedy_request_without_drafts_gets_its_argmax() -> None:
    logits = logits_with_argmax([6], 8)
    assert rejection_sampler()(logits, metadata([GREEDY], 8), [[]], [0]) == [[6]]


def test_greedy_several_requests_in_one_call() -> None:
    vocab = 16
    # Request 0: 2 drafts, both right. Request 1: none. Request 2: 3 drafts, the second wrong. Request 3: 1 wrong.
    argmax = [2, 7, 9] + [11] + [4, 4, 8, 0] + [13, 5]
    drafts = [[2, 7], [], [4, 5, 8], [12]]
    starts = layout(drafts)
    assert starts == [0, 3, 4, 8]
    logits = logits_with_argmax(argmax, vocab, seed=3)
    out = rejection_sampler()(logits, metadata([GREEDY] * len(argmax), vocab), drafts, starts)
    assert out == [[2, 7, 9], [11], [4, 4], [13]]


def test_greedy_rows_follow_the_processed_logits() -> None:
    vocab = 8
    argmax = [1, 2, 3]
    logits = logits_with_argmax(argmax, vocab)
    # A logit bias on the second row makes 6 its argmax there: draft 2 is then rejected in favour of 6.
    params = [GREEDY, SamplingParams(temperature=0.0, logit_bias={6: 100.0}), GREEDY]
    out = rejection_sampler()(logits, metadata(params, vocab), [[1, 2]], [0])
    assert out == [[1, 6]]


def test_greedy_rows_among_random_rows() -> None:
    torch.manual_seed(5)
    vocab = 8
    argmax = [1, 2, 3, 0, 0]
    logits = logits_with_argmax(argmax, vocab)
    hot = SamplingParams(temperature=1.0)
    # Request 0 greedy (3 rows), request 1 random (2 rows): the greedy one is exact whatever the noise.
    params = [GREEDY] * 3 + [hot] * 2
    for _ in range(20):
        out = rejection_sampler()(logits, metadata(params, vocab), [[1, 2], [5]], [0, 3])
        assert out[0] == [1, 2, 3]
        assert 1 <= len(out[1]) <= 2


def test_input_logits_untouched() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 10)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9)] * 4
    rejection_sampler()(logits, metadata(params, 10), [[1, 2, 3]], [0])
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------------------------
# Random rows: the output distribution

VOCAB = 6
ROW_LOGITS = torch.tensor(
    [
        [1.0, 0.0, 2.0, -1.0, 0.5, 1.5],
        [0.2, 1.8, -0.5, 0.9, 0.0, 1.1],
        [-0.3, 0.4, 0.1, 1.6, 1.2, -1.0],
    ]
)
TRIALS = 30000


def run_trials(drafts: list[int], trials: int = TRIALS, seed: int = 0) -> list[list[int]]:
    """`trials` requests in one call, each with the same drafts and the same rows of logits (ROW_LOGITS[j] at draft
    position j), temperature 1."""
    torch.manual_seed(seed)
    rows = len(drafts) + 1
    logits = ROW_LOGITS[:rows].repeat(trials, 1)
    md = metadata([SamplingParams(temperature=1.0)] * (rows * trials), VOCAB)
    return rejection_sampler()(logits, md, [list(drafts)] * trials, [rows * i for i in range(trials)])


def test_first_token_distributed_as_p_with_one_draft() -> None:
    p = torch.softmax(ROW_LOGITS[0], dim=-1)
    p1 = torch.softmax(ROW_LOGITS[1], dim=-1)
    for seed, draft in enumerate((2, 3)):  # the likeliest token, and an unlikely one
        out = run_trials([draft], seed=seed)
        first = torch.tensor([o[0] for o in out])
        assert_distributed_as(first, p)
        # Accepted drafts are followed by the second row's token; rejected ones end the output.
        accepted = [o for o in out if o[0] == draft]
        assert all(len(o) == 2 for o in accepted)
        assert all(len(o) == 1 for o in out if o[0] != draft)
        assert_distributed_as(torch.tensor([o[1] for o in accepted]), p1)


def test_two_drafts_joint_distribution() -> None:
    d0, d1 = 0, 1
    p = [torch.softmax(r, dim=-1) for r in ROW_LOGITS]
    out = run_trials([d0, d1], seed=11)
    assert_distributed_as(torch.tensor([o[0] for o in out]), p[0])
    after_first = [o for o in out if o[0] == d0]
    assert_distributed_as(torch.tensor([o[1] for o in after_first]), p[1])
    after_both = [o for o in after_first if o[1] == d1]
    assert_distributed_as(torch.tensor([o[2] for o in after_both]), p[2])
    # Output lengths 1, 2, 3: the draft rejected at once, the second one rejected, both accepted.
    a0, a1 = float(p[0][d0]), float(p[1][d1])
    length_probs = torch.tensor([1 - a0, a0 * (1 - a1), a0 * a1])
    lengths = torch.tensor([len(o) - 1 for o in out])
    stat, df = chi_square(torch.bincount(lengths, minlength=3), length_probs)
    assert stat < CHI2_999[df], stat


def test_the_statistic_rejects_broken_rules() -> None:
    """Rules implemented here (one draft d, n trials): the correct one passes the test above's check, two wrong ones
    fail it. So the chi-square check can detect a sampler that is wrong in either way."""
    torch.manual_seed(21)
    p = torch.softmax(ROW_LOGITS[0], dim=-1)
    d, n = 0, TRIALS
    accept = torch.rand(n) < p[d]
    without_d = p.clone()
    without_d[d] = 0
    correct = torch.where(accept, d, torch.multinomial(without_d, n, replacement=True))
    assert_distributed_as(correct, p)
    # Broken 1: the draft is always accepted.
    assert_not_distributed_as(torch.full((n,), d), p)
    # Broken 2: a rejected draft is resampled from p itself (d not removed): d comes out too often.
    resample_with_d = torch.where(accept, d, torch.multinomial(p, n, replacement=True))
    assert_not_distributed_as(resample_with_d, p)
    # Broken 3: the second row's distribution used for the first token.
    assert_not_distributed_as(torch.multinomial(torch.softmax(ROW_LOGITS[1], dim=-1), n, replacement=True), p)


def test_a_draft_outside_the_support_is_never_accepted() -> None:
    torch.manual_seed(4)
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf"), 0.5, -1.0], [0.0] * vocab]).repeat(2000, 1)
    md = metadata([SamplingParams(temperature=1.0)] * 4000, vocab)
    out = rejection_sampler()(logits, md, [[3]] * 2000, [2 * i for i in range(2000)])
    assert all(len(o) == 1 and o[0] != 3 for o in out)


# ------------------------------------------------------------------------------------------------
# Seeds


def test_seeded_requests_repeat_their_tokens() -> None:
    vocab = 50
    seeds = [7, 8, 9, 10, None]
    drafts = [[1, 2, 3], [], [4], [5, 6], [7]]
    starts = layout(drafts)
    num_rows = starts[-1] + len(drafts[-1]) + 1
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]

    def call() -> list[list[int]]:
        row_params = [params[i] for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
        positions = [j for d in drafts for j in range(len(d) + 1)]
        # The default RNG differs between the calls: seeded rows must not depend on it.
        torch.manual_seed(len(calls))
        return rejection_sampler()(logits, metadata(row_params, vocab, positions), drafts, starts)

    calls: list[list[list[int]]] = []
    for _ in range(3):
        calls.append(call())
    assert calls[0][:4] == calls[1][:4] == calls[2][:4]
    # Different seeds give different tokens (a flat-ish distribution over 50 tokens); the unseeded request beside
    # them draws from the default RNG, which differs between the calls.
    assert len({o[-1] for o in calls[0][:4]}) > 1
    assert len({tuple(c[4]) for c in calls}) > 1


def test_seeded_output_equals_plain_sampling() -> None:
    """The t-th output token of a seeded request comes from its t-th draw, however many drafts were proposed, so
    verifying drafts gives the tokens plain sampling gives."""
    vocab, seed, steps = 40, 1234, 4
    params = SamplingParams(temperature=0.9, top_k=20, seed=seed)
    rows = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(1))
    # Plain sampling, one row (position) per step.
    plain = [
        int(Sampler(NATIVE)(rows[t : t + 1], metadata([params], vocab, [t])).sampled_token_ids[0]) for t in range(steps)
    ]
    assert len(set(plain)) > 1
    wrong = [(t + 1) % vocab for t in plain]  # a draft differing from plain sampling at each position

    for drafts in ([], plain[:3], [wrong[0], 0, 0], plain[:1] + [wrong[1]], plain[:2] + [wrong[2]]):
        n = len(drafts) + 1
        out = rejection_sampler()(rows[:n], metadata([params] * n, vocab, list(range(n))), [drafts], [0])[0]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == plain[accepted]:
            accepted += 1
        assert out == plain[: accepted + 1], drafts


# ------------------------------------------------------------------------------------------------
# Filters


def test_tokens_outside_top_k_never_appear() -> None:
    torch.manual_seed(13)
    vocab, k, trials = 12, 3, 3000
    rows = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    top = [set(r.topk(k).indices.tolist()) for r in rows]
    outside = [next(t for t in range(vocab) if t not in s) for s in top]
    inside = [min(s) for s in top]
    params = SamplingParams(temperature=1.5, top_k=k)
    for drafts in ([outside[0], inside[1]], [inside[0], outside[1]], [inside[0], inside[1]]):
        logits = rows.repeat(trials, 1)
        md = metadata([params] * (3 * trials), vocab)
        out = rejection_sampler()(logits, md, [drafts] * trials, [3 * i for i in range(trials)])
        seen: list[set[int]] = [set(), set(), set()]
        for o in out:
            for j, t in enumerate(o):
                assert t in top[j], (drafts, o)
                seen[j].add(t)
        assert seen[0] == top[0]  # every kept token does come out
        if drafts[0] == inside[0]:
            assert seen[1]  # the draft was accepted at least sometimes


def kept_tokens(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens vLLM's filters keep: the top_k likeliest (all when top_k < 0), then the smallest prefix of those,
    likeliest first, whose renormalised mass reaches top_p."""
    probs = torch.softmax(row / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    total = sum(float(probs[t]) for t in order)
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += float(probs[t]) / total
        if mass >= top_p:
            break
    return set(kept)


def test_tokens_outside_top_p_and_top_k_never_appear() -> None:
    torch.manual_seed(17)
    vocab, trials, temperature, top_p = 10, 3000, 0.8, 0.8
    row = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.0, -0.5, 3.0, -1.0, 0.2])
    only_p = kept_tokens(row, temperature, -1, top_p)
    k_then_p = kept_tokens(row, temperature, 3, top_p)
    assert len(only_p) > len(k_then_p) > 1
    for params, allowed in (
        (SamplingParams(temperature=temperature, top_p=top_p), only_p),
        (SamplingParams(temperature=temperature, top_p=top_p, top_k=3), k_then_p),
    ):
        draft = int(row.argmin())  # the least likely token, outside both sets
        logits = row.repeat(2 * trials, 1)
        md = metadata([params] * (2 * trials), vocab)
        out = rejection_sampler()(logits, md, [[draft]] * trials, [2 * i for i in range(trials)])
        assert all(len(o) == 1 for o in out)
        assert {o[0] for o in out} == allowed
