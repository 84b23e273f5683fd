"""The native sampling kernels (csrc/cpu/sampling.cpp) against the sampler's torch path, for every ISA build this
CPU runs (tests/model/conftest.py).

The torch path (topk, and a stable sort of the whole row for top-p) is itself checked against a naive per-row
reference in tests/unit/test_sampler.py (which also runs every sampler test with the native kernels). Here:
* The native top-k and top-p filters alone, given torch's softmax, must give the very same logits, bit for bit and
  -inf for -inf, on rows of a real vocabulary's size: peaked and flat distributions, ties at the cut, -inf entries, p
  near 0 and near 1, probabilities that underflow to 0, k of 1, of more than the finite logits and of the whole
  vocabulary, rows of one token; a row's result must not depend on its batch; bad input is refused.
* `sample_rows`, the sampler's whole step in one call (its own softmax): the torch path's token at every u but for
  rounding, never a token without mass, greedy rows' first largest logit, logits untouched, rows independent of the
  batch, bad input refused; and the Sampler's seeded tokens with it are those of the torch path on these rows.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, _apply_top_k_top_p
from pagedllm.sampling_params import SamplingParams

VOCAB = 49152


@pytest.fixture
def ops(isa_ops):
    return isa_ops


def _native_filters(ops, logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The native filters in place on logits, as sample_rows applies them: top-k, then top-p on the row's softmax
    (here torch's, so that the result must equal the torch path's bit for bit)."""
    if top_k is not None:
        ops.top_k_mask(logits, top_k.to(torch.int64).contiguous())
    if top_p is not None:
        ops.top_p_mask(logits, torch.softmax(logits, dim=-1), top_p.to(torch.float32).contiguous())
    return logits


def _both(ops, logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor | None = None):
    torch_out = _apply_top_k_top_p(logits.clone(), top_k, top_p)
    native_out = _native_filters(ops, logits.clone(), top_k, top_p)
    return torch_out, native_out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "case, scale, ps",
    [
        ("peaked", 4.0, [0.5, 0.9, 0.95, 0.99, 0.3, 1e-7, 1.0, 0.8]),
        ("flat", 0.05, [0.9, 0.5, 0.999, 0.1]),
        ("underflow", 60.0, [0.999999, 0.9999999, 0.99, 0.5]),
        ("near_one", 1.0, [0.99999, 0.999999, 0.9999999, 0.99999994]),
    ],
)
def test_native_top_p_equals_torch(ops, case: str, scale: float, ps: list[float]) -> None:
    g = _gen(len(case))
    logits = torch.randn(len(ps), VOCAB, generator=g) * scale
    top_p = torch.tensor(ps)
    ref, got = _both(ops, logits, top_p)
    assert torch.equal(got, ref)
    kept = torch.isfinite(got).sum(dim=-1)
    # Rows with p = 1 are untouched; the others lost tokens (peaked rows most of them).
    assert all(k == VOCAB for k, p in zip(kept.tolist(), ps) if p >= 1.0)
    if case == "peaked":
        assert 0 < int(kept[1]) < VOCAB // 10


def test_native_top_p_ties_at_the_cut(ops) -> None:
    # Logits of one decimal, as bf16 logits tie: the cut falls among equal logits, and the lower ids are kept.
    g = _gen(1)
    rows = 64
    logits = (torch.randn(rows, 5000, generator=g) * 2).round(decimals=1)
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    ref, got = _both(ops, logits, top_p)
    assert torch.equal(got, ref)
    # A row of equal logits: p = 0.5 keeps exactly the lower half of the ids.
    flat = torch.zeros(1, 1000)
    ref, got = _both(ops, flat, torch.tensor([0.5]))
    assert torch.equal(got, ref)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == list(range(500))


def test_native_top_p_after_top_k(ops) -> None:
    # Top-k leaves -inf entries (probability 0); some rows without top-k, one with k = 1, one with p = 1.
    g = _gen(2)
    rows = 10
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    top_k = torch.tensor([5, 50, 1, VOCAB, 1000, VOCAB, 20, 2, 300, 7])
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.95, 0.99, 1.0, 0.2, 0.7, 0.999999, 1e-6])
    ref, got = _both(ops, logits, top_p, top_k)
    assert torch.equal(got, ref)
    # A row with a single finite logit (probability exactly 1) keeps it.
    one = torch.full((1, 100), float("-inf"))
    one[0, 42] = 3.0
    ref, got = _both(ops, one, torch.tensor([0.5]))
    assert torch.equal(got, ref)
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [42]


def test_native_top_k_equals_torch(ops) -> None:
    g = _gen(5)
    rows = 12
    logits = torch.randn(rows, VOCAB, generator=g) * torch.linspace(0.05, 8.0, rows).unsqueeze(1)
    logits[3] = logits[3].round(decimals=1)  # ties at the k-th value: the lower ids are kept
    logits[4, 100:] = float("-inf")  # fewer finite logits than k
    logits[5] = 0.0  # every logit tied
    top_k = torch.tensor([1, 50, 5000, 40, 200, 7, VOCAB, VOCAB - 1, 2, 1000, 3, 64])
    ref = _apply_top_k_top_p(logits.clone(), top_k, None)
    got = _native_filters(ops, logits.clone(), top_k, None)
    assert torch.equal(got, ref)
    kept = torch.isfinite(got).sum(dim=-1).tolist()
    assert kept[0] == 1 and kept[1] == 50 and kept[4] == 100 and kept[6] == VOCAB
    assert torch.isfinite(got[5]).nonzero().flatten().tolist() == list(range(7))
    for r in (0, 2, 9):  # each row alone as in the batch
        alone = _native_filters(ops, logits[r : r + 1].clone(), top_k[r : r + 1], None)
        assert torch.equal(alone[0], got[r])


def test_native_top_k_on_peaked_rows(ops) -> None:
    # A few logits far above the rest, as a model's rows have them: the candidates' floor is narrowed by bisection
    # (doubling alone jumps from the peak to most of the vocabulary); ties at the k-th value in a rounded row.
    g = _gen(6)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    logits[:, [5, 900, 40000]] += torch.tensor([40.0, 30.0, 30.0])
    logits[2] = logits[2].round(decimals=0)
    logits[3, 17] = 1e4
    top_k = torch.tensor([50, 2, 40, 1000])
    ref = _apply_top_k_top_p(logits.clone(), top_k, None)
    got = _native_filters(ops, logits.clone(), top_k, None)
    assert torch.equal(got, ref)
    assert torch.isfinite(got).sum(dim=-1).tolist() == top_k.tolist()


def test_native_top_p_row_independent_of_batch(ops) -> None:
    g = _gen(3)
    logits = torch.randn(6, VOCAB, generator=g) * torch.tensor([[0.1], [1.0], [3.0], [6.0], [0.5], [2.0]])
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.999, 1.0, 0.75])
    batched = _native_filters(ops, logits.clone(), None, top_p)
    for r in range(6):
        alone = _native_filters(ops, logits[r : r + 1].clone(), None, top_p[r : r + 1])
        assert torch.equal(alone[0], batched[r])


def test_sampler_with_native_filters_draws_the_same_seeded_tokens(ops) -> None:
    g = _gen(4)
    rows = 8
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    params = [
        SamplingParams(temperature=0.8, top_p=p, top_k=k, seed=i)
        for i, (p, k) in enumerate(zip([0.9, 0.95, 0.5, 1.0] * 2, [-1, 50, -1, 20, 1, -1, 100, -1]))
    ]

    def draw(native) -> list[int]:
        tokens = []
        for step in range(5):
            md = SamplingMetadata.from_requests(
                params,
                prompt_token_ids=[[0, 1]] * rows,
                output_token_ids=[[0] * step for _ in range(rows)],
                eos_token_ids=[None] * rows,
                vocab_size=VOCAB,
                device=torch.device("cpu"),
            )
            tokens += Sampler(native)(logits, md).sampled_token_ids.tolist()
        return tokens

    tokens = draw(ops)
    assert tokens == draw(None)
    assert len(set(tokens[:rows])) > 1 and tokens[:rows] != tokens[rows : 2 * rows]  # rows and steps draw anew


def test_native_filters_refuse_bad_input(ops) -> None:
    logits = torch.randn(2, 10)
    probs = torch.softmax(logits, dim=-1)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.top_p_mask(logits, probs[:1].contiguous(), torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="one shape"):
        ops.top_p_mask(logits, probs, torch.tensor([0.5]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.top_p_mask(logits.double(), probs, torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="overlap"):
        ops.top_p_mask(logits, logits, torch.tensor([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="top_k"):
        ops.top_k_mask(logits, torch.tensor([3, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"top_k \[R\]"):
        ops.top_k_mask(logits, torch.tensor([3]))


def _inverse_reference(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token at u of each row's cumulative distribution (float64), and how far u * total lies from the nearest
    boundary of the cumulative sums (relative to the total)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = u.unsqueeze(1) * total
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    gap = ((cdf - target).abs() / total).min(dim=-1).values
    return token, gap


def test_native_inverse_cdf_draws_the_token_at_u(ops) -> None:
    g = _gen(6)
    rows = 400
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=g) * 3, dim=-1)
    probs[: rows // 2] *= 0.37  # unnormalised rows
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    out = torch.empty(rows, dtype=torch.int64)
    ops.sample_inverse(out, probs, u)
    expected, gap = _inverse_reference(probs, u)
    far = gap > 1e-6  # u not within rounding of a boundary: both sums must agree on the token
    assert far.sum() > rows * 0.8
    assert torch.equal(out[far], expected[far])


def test_native_inverse_cdf_never_draws_a_token_without_mass(ops) -> None:
    vocab = 1000
    probs = torch.zeros(6, vocab)
    probs[0, 0] = 1.0  # one token, first
    probs[1, vocab - 1] = 0.5  # one token, last
    probs[2, 10:20] = 0.1  # a few tokens amid zeros
    probs[3, 500] = 1e-30  # a tiny mass alone
    probs[4, :7] = torch.tensor([0.0, 0.2, 0.0, 0.3, 0.0, 0.5, 0.0])
    probs[5, 990:] = 1.0  # trailing block
    with_mass = [set(torch.nonzero(probs[r]).flatten().tolist()) for r in range(6)]
    for u in (0.0, 1e-300, 0.5, 1.0 - 2**-53):
        out = torch.empty(6, dtype=torch.int64)
        ops.sample_inverse(out, probs, torch.full((6,), u, dtype=torch.float64))
        for r in range(6):
            assert int(out[r]) in with_mass[r], (u, r)
    out = torch.empty(6, dtype=torch.int64)
    ops.sample_inverse(out, probs, torch.full((6,), 1.0 - 2**-53, dtype=torch.float64))
    assert out.tolist()[:5] == [0, vocab - 1, 19, 500, 5]


def _metadata(params: list[SamplingParams], vocab: int, positions: list[int] | None = None) -> SamplingMetadata:
    """Rows of `params`; a seeded row's draw index is its entry of `positions` (0 without)."""
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompt_token_ids=[[0, 1]] * n,
        output_token_ids=[[] for _ in range(n)],
        eos_token_ids=[None] * n,
        vocab_size=vocab,
        device=torch.device("cpu"),
        draft_pos=positions,
    )


@pytest.mark.parametrize("vocab", [37, 32001])
def test_native_filters_on_odd_vocabularies(ops, vocab: int) -> None:
    # Vocabularies that are not a multiple of the vector width: the scalar tails of every pass.
    g = _gen(vocab)
    rows = 16
    logits = (torch.randn(rows, vocab, generator=g) * 3).round(decimals=1)
    logits[0, -1] = logits[0].max() + 1  # the largest logit in the tail
    top_k = torch.randint(1, vocab, (rows,), generator=g)
    top_k[::4] = vocab
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    top_p[1::5] = 1.0
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        ref = _apply_top_k_top_p(logits.clone(), k, p)
        got = _native_filters(ops, logits.clone(), k, p)
        assert torch.equal(got, ref)


def test_sampler_with_native_draws_the_distribution(ops) -> None:
    # Unseeded rows go through the native inverse CDF: after top-p and min-p (on a vocabulary that is not a multiple
    # of the vector width), the frequencies match the kept tokens' renormalised distribution (chi-square, fixed
    # seed), and a filtered-out token never appears.
    torch.manual_seed(7)
    rows, vocab = 20000, 37
    p = torch.rand(vocab, generator=_gen(8)) + 0.05
    p[[3, 20, 36]] = 2.0  # a few large tokens, one in the tail
    p /= p.sum()
    logits = p.log().expand(rows, -1).contiguous()
    order = p.argsort(descending=True, stable=True)
    before = p[order].double().cumsum(0) - p[order].double()
    kept = order[before < 0.6]  # top_p = 0.6
    params = [SamplingParams(temperature=1.0, top_p=0.6)] * rows
    counts = torch.bincount(Sampler(ops)(logits, _metadata(params, vocab)).sampled_token_ids, minlength=vocab)
    assert int(counts.sum()) == rows and int(counts[kept].sum()) == rows
    q = p[kept].double() / p[kept].double().sum()
    chi2 = float(((counts[kept].double() - rows * q) ** 2 / (rows * q)).sum())
    df = len(kept) - 1
    assert 2 <= df < vocab // 2
    # The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty; within 1% from df = 2 on).
    assert chi2 < df * (1 - 2 / (9 * df) + 3.0902 * (2 / (9 * df)) ** 0.5) ** 3
    # min-p zeroes tokens without renormalising: the native draw never picks them either.
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 2000
    drawn = set(Sampler(ops)(logits[:2000], _metadata(params, vocab)).sampled_token_ids.tolist())
    assert drawn == set(torch.nonzero(p >= 0.5 * p.max()).flatten().tolist())


def test_native_seeded_rows_unchanged_beside_unseeded_ones(ops) -> None:
    # Seeded rows draw at their seed and draw index alone: the same tokens with the native ops as without, beside
    # unseeded rows or alone.
    g = _gen(9)
    rows = 6
    logits = torch.randn(rows, 5000, generator=g) * 2
    seeded = [0, 2, 3, 5]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=k, seed=10 + r if r in seeded else None)
        for r, k in enumerate((-1, 40, -1, 7, -1, 300))
    ]
    positions = [0, 0, 3, 1, 0, 9]

    def run(native, rows_in: list[int]) -> list[int]:
        md = _metadata([params[r] for r in rows_in], 5000, [positions[r] for r in rows_in])
        tokens = Sampler(native)(logits[rows_in], md).sampled_token_ids.tolist()
        return [t for r, t in zip(rows_in, tokens) if r in seeded]

    together = run(ops, list(range(rows)))
    assert together == run(None, list(range(rows))) == run(ops, seeded) == run(None, seeded)


def test_native_rejection_sampler_keeps_seeded_requests(ops) -> None:
    # A seeded request verifying two drafts beside an unseeded one: its tokens are the same with the native ops as
    # without.
    from pagedllm.spec_decode.rejection_sampler import RejectionSampler

    g = _gen(10)
    logits = torch.randn(6, 5000, generator=g) * 2
    logits[0, 17] = logits[1, 4000] = 20.0  # the drafts, near certain
    drafts = [[17, 4000], [1, 2]]
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=3)] * 3 + [SamplingParams(temperature=0.7, top_k=50)] * 3

    def run(native) -> list[int]:
        md = _metadata(params, 5000, [0, 1, 2, 0, 1, 2])
        return RejectionSampler(native)(logits, md, drafts, [0, 3])[0]

    a, b = run(ops), run(None)
    assert a == b
    assert a[:2] == [17, 4000]  # both drafts accepted (their probability is ~1 - 1e-5)


# sample_rows: the sampler's whole step on CPU rows in one native call (temperature, top-k, top-p on the row's own
# softmax, min-p, the inverse-CDF draw; the argmax for greedy rows), the logits read only.

# (temperature, top_k, top_p, min_p): the candidate draw (a filter keeps few tokens) and the whole-row draw (none
# does, or it keeps many), each filter alone and together.
_SETTINGS = [
    (0.8, -1, 1.0, 0.0),
    (1.3, 50, 1.0, 0.0),
    (0.7, -1, 0.9, 0.0),
    (1.0, 40, 0.95, 0.0),
    (0.9, -1, 1.0, 0.1),
    (0.6, 300, 0.8, 0.05),
    (1.0, 1, 1.0, 0.0),
    (1.0, 20000, 1.0, 0.0),
    (2.0, -1, 0.999, 0.0),
    (1.0, -1, 0.9999, 0.0),
    (1.0, 60, 0.9999999, 0.0),
]


def _sample_rows(ops, logits: torch.Tensor, md: SamplingMetadata, u: torch.Tensor) -> list[int]:
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ops.sample_rows(out, logits, md.temperature, md.top_k, md.top_p, md.min_p, u)
    return out.tolist()


@pytest.mark.parametrize("vocab", [37, 32001, VOCAB])
def test_sample_rows_draws_the_torch_paths_token_at_every_u(ops, vocab: int) -> None:
    from pagedllm.sample.sampler import processed_logits, sampling_probs

    g = _gen(11)
    logits = torch.randn(len(_SETTINGS), vocab, generator=g) * 3
    logits[:, vocab // 3] = logits.max() + 2  # one dominant token
    logits[:, 7::29] = float("-inf")  # masked tokens (min_tokens, a grammar)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in _SETTINGS]
    md = _metadata(params, vocab)
    probs = sampling_probs(processed_logits(logits, md), md).double()  # the torch path's distribution
    us = torch.cat([torch.tensor([0.0, 1.0 - 2**-53]), torch.rand(254, generator=g, dtype=torch.float64)])
    for r, setting in enumerate(_SETTINGS):
        cdf = probs[r].cumsum(0)
        cdf /= cdf[-1].clone()
        want = torch.searchsorted(cdf, us, right=True).clamp(max=int(torch.nonzero(probs[r]).max()))
        rows = logits[r].expand(len(us), -1).contiguous()
        got = torch.tensor(_sample_rows(ops, rows, _metadata([params[r]] * len(us), vocab), us))
        # The token at u, but for rounding: the two softmaxes differ in the last bits, and so do their sums (torch's
        # float32 probs of a row of 49152 may sum to 1 + 1e-5), which moves a top-p cut in a long tail and with it
        # every boundary by up to that much. So the token's interval of torch's cumulative distribution must hold u
        # within 3e-5.
        lo = torch.where(got > 0, cdf[(got - 1).clamp(min=0)], torch.zeros_like(us))
        assert bool(((lo - 3e-5 <= us) & (us < cdf[got] + 3e-5)).all()), setting
        if setting[2] == 1.0:  # the same tokens have mass in both
            assert bool((probs[r][got] > 0).all()), setting
        assert int((got == want).sum()) >= 0.9 * len(us), setting


def test_sample_rows_greedy_rows_take_the_first_largest(ops) -> None:
    g = _gen(12)
    logits = torch.randn(5, VOCAB, generator=g)
    logits[1, [7, 30000]] = 50.0  # a tie: the lower id
    logits[2, :] = float("-inf")
    logits[2, 40000] = 0.0
    logits[3, VOCAB - 1] = 99.0  # in the last vector's tail
    logits[4, 123] = float("nan")  # torch.argmax counts NaN as the largest
    md = _metadata([SamplingParams(temperature=0.0)] * 5, VOCAB)
    got = _sample_rows(ops, logits, md, torch.zeros(5, dtype=torch.float64))
    assert got == logits.argmax(dim=-1).tolist()
    assert got[1] == 7 and got[4] == 123


def test_sample_rows_reads_the_logits_only_and_rows_stand_alone(ops) -> None:
    g = _gen(13)
    rows = len(_SETTINGS) + 2
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    before = logits.clone()
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in _SETTINGS]
    params += [SamplingParams(temperature=0.0)] * 2
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    together = _sample_rows(ops, logits, _metadata(params, VOCAB), u)
    assert torch.equal(logits, before)
    alone = [_sample_rows(ops, logits[r : r + 1], _metadata([params[r]], VOCAB), u[r : r + 1])[0] for r in range(rows)]
    assert together == alone


def test_sample_rows_refuses_bad_input(ops) -> None:
    logits = torch.randn(2, 10)
    md = _metadata([SamplingParams(temperature=1.0, top_k=3, top_p=0.5)] * 2, 10)
    out, u = torch.empty(2, dtype=torch.int64), torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="u must be"):
        ops.sample_rows(out, logits, md.temperature, md.top_k, md.top_p, None, u.float())
    with pytest.raises(RuntimeError, match="top_k must have one entry per row"):
        ops.sample_rows(out, logits, md.temperature, md.top_k[:1].contiguous(), md.top_p, None, u)
    with pytest.raises(RuntimeError, match="temperature must be"):
        ops.sample_rows(out, logits, md.temperature.double(), None, None, None, u)
    with pytest.raises(RuntimeError, match="top_p must be"):
        ops.sample_rows(out, logits, md.temperature, None, md.top_p.double(), None, u)
    with pytest.raises(RuntimeError, match="min_p must have one entry per row"):
        ops.sample_rows(out, logits, md.temperature, None, None, torch.zeros(3), u)
    with pytest.raises(RuntimeError, match="logits must be"):
        ops.sample_rows(out, logits.t(), md.temperature, None, None, None, u)
