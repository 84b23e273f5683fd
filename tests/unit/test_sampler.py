"""Unit tests for pagedllm.sample: SamplingMetadata.from_requests, the Sampler and compute_token_logprobs.

All on CPU with small hand-made logits. Statistical tests use fixed seeds, so they are deterministic. Every test
runs twice: on the sampler's torch path, and with the native CPU kernels (`sample_rows`, the path CPU rows take in the
engine) where they are built.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from pagedllm.engine.protocol import LogprobsLists
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import (
    LogprobsTensors,
    Sampler,
    apply_penalties,
    compute_token_logprobs,
    seeded_uniforms,
)
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
NATIVE = None  # the native CPU ops of the running case, or None (the torch path): tests/unit/conftest.py
pytestmark = pytest.mark.usefixtures("sampler_backend")


def make_sampler() -> Sampler:
    return Sampler(NATIVE)


def make_md(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: list[int | None] | None = None,
    draft_pos: list[int] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompt_token_ids=prompts if prompts is not None else [[0, 1] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        eos_token_ids=eos if eos is not None else [None] * n,
        vocab_size=vocab,
        device=CPU,
        draft_pos=draft_pos,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw) -> torch.Tensor:
    return make_sampler()(logits, make_md(params, logits.shape[-1], **kw)).sampled_token_ids


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def seeded(seed: int, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, **kw)


GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------------------------------------
# SamplingMetadata


def test_metadata_from_requests_fields() -> None:
    params = [
        SamplingParams(temperature=0.0, seed=0),
        SamplingParams(temperature=0.7, top_k=5, logprobs=3, seed=1),
        SamplingParams(top_p=0.9, min_p=0.1, logprobs=1),
        SamplingParams(repetition_penalty=1.2, min_tokens=2, stop_token_ids=[7], seed=3),
    ]
    md = make_md(
        params,
        vocab=10,
        prompts=[[1], [2, 3, 4], [], [5, 6]],
        outputs=[[], [], [], [9]],
        eos=[2, 2, 2, 2],
    )
    assert md.temperature.dtype == torch.float32
    assert md.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0, 1.0])
    assert not md.all_greedy and not md.all_random
    assert md.top_k is not None and md.top_k.tolist() == [10, 5, 10, 10]
    assert md.top_p is not None and md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert md.min_p is not None and md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0])
    # Random rows with a seed: (seed, draw index = tokens output so far); the greedy row's seed is left out.
    assert md.seeds == {1: (1, 0), 3: (3, 1)}
    assert not md.no_penalties
    assert md.prompt_token_ids is not None
    assert md.prompt_token_ids.tolist() == [[1, 10, 10], [2, 3, 4], [10, 10, 10], [5, 6, 10]]
    assert md.min_tokens == {3: (2, {7, 2})}
    assert md.max_num_logprobs == 3


def test_metadata_neutral_when_unused() -> None:
    md = make_md([GREEDY, SamplingParams(temperature=1.0)], vocab=8)
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.prompt_token_ids is None
    assert md.max_num_logprobs is None and md.min_tokens == {} and md.logit_bias == [None, None]
    assert make_md([GREEDY, GREEDY], vocab=8).all_greedy
    assert make_md([SamplingParams()], vocab=8).all_random


def test_metadata_min_tokens_and_ignore_eos() -> None:
    p = SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[4, 99])
    md = make_md([p, SamplingParams(min_tokens=2)], vocab=8, eos=[3, 3], outputs=[[1], [1, 2]])
    # ignore_eos drops eos; out-of-range ids are dropped; row 1 already has min_tokens outputs.
    assert md.min_tokens == {0: (2, {4})}


# ------------------------------------------------------------------------------------------------
# Greedy and filters


def test_greedy_is_argmax_and_input_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50, dtype=torch.bfloat16)
    before = logits.clone()
    rng_state = torch.get_rng_state()
    out = make_sampler()(logits, make_md([GREEDY] * 6, 50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)
    # Greedy never consumes randomness.
    assert torch.equal(torch.get_rng_state(), rng_state)


def test_empty_batch() -> None:
    out = make_sampler()(torch.empty(0, 16), make_md([], 16))
    assert out.sampled_token_ids.shape == (0,)


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 30)
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=1.5, top_p=0.95) for i in range(8)]
    params[0] = SamplingParams(temperature=0.0, seed=5)
    assert 0 not in make_md(params, 30).seeds  # a greedy row's seed draws nothing
    for _ in range(5):
        tokens = sample(logits, params)
        assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 100)
    # Ties included: a stable sort keeps the first index, like argmax.
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1.0
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 16)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_p_tiny_equals_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(16, 100)
    tokens = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 16)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def _probs_logits(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def test_top_p_keeps_smallest_prefix() -> None:
    torch.manual_seed(4)
    logits = _probs_logits([0.05, 0.5, 0.15, 0.3], 2000)
    # Sorted masses 0.5, 0.3, 0.15, 0.05: top_p=0.75 needs {1, 3}; top_p=0.85 needs {1, 3, 2}.
    seen = set(sample(logits, [SamplingParams(top_p=0.75)] * 2000).tolist())
    assert seen == {1, 3}
    seen = set(sample(logits, [SamplingParams(top_p=0.85)] * 2000).tolist())
    assert seen == {1, 2, 3}


def test_top_k_keeps_k_most_likely() -> None:
    torch.manual_seed(5)
    logits = _probs_logits([0.05, 0.5, 0.15, 0.3], 2000)
    assert set(sample(logits, [SamplingParams(top_k=2)] * 2000).tolist()) == {1, 3}


def test_min_p_filters() -> None:
    torch.manual_seed(6)
    logits = _probs_logits([0.05, 0.5, 0.15, 0.3], 4000)
    # Threshold 0.2 * 0.5 = 0.1 drops token 0 (p=0.05) only.
    assert set(sample(logits, [SamplingParams(min_p=0.2)] * 4000).tolist()) == {1, 2, 3}
    # Threshold 0.5 * 0.5 = 0.25 drops tokens 0 and 2.
    assert set(sample(logits, [SamplingParams(min_p=0.5)] * 4000).tolist()) == {1, 3}
    # Without min_p every token shows up in 4000 draws.
    assert set(sample(logits, [SamplingParams()] * 4000).tolist()) == {0, 1, 2, 3}


def test_per_row_filters_in_one_batch() -> None:
    torch.manual_seed(7)
    rows = 3000
    logits = _probs_logits([0.05, 0.5, 0.15, 0.3], rows)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.75), SamplingParams()] * (rows // 3)
    tokens = sample(logits, params)
    assert set(tokens[0::3].tolist()) == {1}
    assert set(tokens[1::3].tolist()) == {1, 3}
    assert set(tokens[2::3].tolist()) == {0, 1, 2, 3}


# ------------------------------------------------------------------------------------------------
# Distribution


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_frequencies_follow_softmax_at_temperature_one() -> None:
    torch.manual_seed(8)
    base = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    rows = 40000
    tokens = sample(base.expand(rows, -1).contiguous(), [SamplingParams(temperature=1.0)] * rows)
    expected = torch.softmax(base, dim=-1)
    # Standard error is at most ~0.0025 here; 0.015 is ~6 sigma, and the seed is fixed anyway.
    assert torch.allclose(_frequencies(tokens, 6), expected, atol=0.015)


def test_temperature_changes_distribution() -> None:
    torch.manual_seed(9)
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    rows = 20000
    logits = base.expand(rows, -1).contiguous()
    for temp in (0.5, 2.0):
        freqs = _frequencies(sample(logits, [SamplingParams(temperature=temp)] * rows), 4)
        assert torch.allclose(freqs, torch.softmax(base / temp, dim=-1), atol=0.02)
    cold = _frequencies(sample(logits, [SamplingParams(temperature=0.05)] * rows), 4)
    hot = _frequencies(sample(logits, [SamplingParams(temperature=50.0)] * rows), 4)
    assert cold[0] > 0.999
    assert hot.min() > 0.2  # nearly flat


def test_unseeded_samples_differ() -> None:
    torch.manual_seed(10)
    tokens = sample(torch.zeros(200, 64), [SamplingParams(temperature=1.0)] * 200)
    assert len(set(tokens.tolist())) > 20
    # Consecutive calls with the default RNG give different draws too.
    again = sample(torch.zeros(200, 64), [SamplingParams(temperature=1.0)] * 200)
    assert not torch.equal(tokens, again)


# ------------------------------------------------------------------------------------------------
# Seeds


def test_seeded_row_same_alone_and_in_batch() -> None:
    vocab, steps, seed = 97, 6, 1234
    target = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=seed)
    others = [
        GREEDY,
        SamplingParams(temperature=0.8),  # unseeded: default RNG
        SamplingParams(temperature=1.0, seed=99, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=3),
    ]
    batch_params = others[:2] + [target] + others[2:]
    logit_gen = gen(0)
    alone_tokens: list[int] = []
    batch_tokens: list[int] = []
    out_alone: list[int] = []
    out_batch: list[list[int]] = [[] for _ in range(5)]
    for _ in range(steps):
        batch_logits = torch.randn(5, vocab, generator=logit_gen)
        row = batch_logits[2:3].clone()
        a = sample(row, [target], outputs=[out_alone])
        b = sample(batch_logits, batch_params, outputs=out_batch)
        alone_tokens.append(int(a[0]))
        batch_tokens.append(int(b[2]))
        out_alone.append(int(a[0]))
        for i in range(5):
            out_batch[i].append(int(b[i]))
    assert alone_tokens == batch_tokens
    assert len(set(alone_tokens)) > 1  # each output position draws anew

    # The same seed reproduces the whole sequence.
    logit_gen = gen(0)
    replay: list[int] = []
    for _ in range(steps):
        row = torch.randn(5, vocab, generator=logit_gen)[2:3]
        replay.append(int(sample(row, [target], outputs=[replay])[0]))
    assert replay == alone_tokens


def test_seeded_rows_do_not_touch_default_rng() -> None:
    rng_state = torch.get_rng_state()
    sample(torch.zeros(3, 32), [SamplingParams(seed=s) for s in range(3)])
    assert torch.equal(torch.get_rng_state(), rng_state)
    # Beside an unseeded row (which draws from the default RNG) a seeded row's token stays the same.
    logits = torch.randn(2, 32, generator=gen(3))
    alone = int(sample(logits[:1], [SamplingParams(seed=11)])[0])
    for state in range(4):
        torch.manual_seed(state)
        assert int(sample(logits, [SamplingParams(seed=11), SamplingParams()])[0]) == alone


def test_seeded_uniforms() -> None:
    draws = [(s, i) for s in (0, 1, 2**63, -1, 2**70 + 5) for i in range(4)]
    u = seeded_uniforms(draws)
    assert u.dtype == np.float64 and u.shape == (len(draws),)
    assert ((u >= 0) & (u < 1)).all()
    assert len(set(u.tolist())) == len(draws)  # every seed and index its own value
    assert np.array_equal(u, seeded_uniforms(draws))  # a function of (seed, index) alone
    assert np.array_equal(seeded_uniforms([(3, 7)]), seeded_uniforms([(9, 1), (3, 7)])[1:])
    # Seeds are taken modulo 2^64: -1 is 2^64 - 1, 2^70 + 5 is 2^70 mod 2^64 + 5 = 5.
    assert np.array_equal(seeded_uniforms([(-1, 2)]), seeded_uniforms([(2**64 - 1, 2)]))
    assert np.array_equal(seeded_uniforms([(2**70 + 5, 0)]), seeded_uniforms([(5, 0)]))
    # Uniform: a chi-square over 20 bins of 20000 consecutive draws of one seed, and of one draw of 20000 seeds.
    for values in (seeded_uniforms([(42, i) for i in range(20000)]), seeded_uniforms([(s, 0) for s in range(20000)])):
        counts = np.bincount((values * 20).astype(np.int64), minlength=20)
        chi2 = float(((counts - 1000.0) ** 2 / 1000.0).sum())
        assert chi2 < 43.8, chi2  # the 0.999 quantile with 19 degrees of freedom


def test_seeded_draws_follow_the_distribution() -> None:
    """One seeded request, 20000 output positions over one row: the draws are the row's distribution (chi-square),
    and each is the inverse CDF at its seeded uniform."""
    base = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -3.0, 0.2])
    n = 20000
    params = [seeded(7)]
    expected = torch.softmax(base, dim=-1).double()
    md = make_md(params * n, 8)
    assert md.seeds == {i: (7, 0) for i in range(n)}
    md = make_md(params * n, 8, draft_pos=list(range(n)))  # as if row i were the request's output position i
    assert md.seeds == {i: (7, i) for i in range(n)}
    tokens = make_sampler()(base.expand(n, -1).contiguous(), md).sampled_token_ids
    counts = torch.bincount(tokens, minlength=8).double()
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < 24.3, chi2  # the 0.999 quantile with 7 degrees of freedom
    u = torch.from_numpy(seeded_uniforms([(7, i) for i in range(n)]))
    cdf = torch.softmax(base, dim=-1).cumsum(0, dtype=torch.float64)
    assert torch.equal(tokens, torch.searchsorted(cdf, u * cdf[-1], right=True))


# ------------------------------------------------------------------------------------------------
# Penalties, bias, min_tokens


def test_penalties_exact_values() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        ]
    )
    prompts = [[0, 1], [5]]
    outputs = [[3, 3, 4], [0, 0, 0, 2]]
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.5, frequency_penalty=-0.5, presence_penalty=1.0),
    ]
    md = make_md(params, 6, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone(), md)

    expected = logits.tolist()
    for r, p in enumerate(params):
        seen = set(prompts[r]) | set(outputs[r])
        for t in range(6):
            x = expected[r][t]
            if t in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[r].count(t)
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (1.0 if count else 0.0)
            expected[r][t] = x
    # Spot-check one value by hand: row 0 token 3 is 3.0 / 2 - 0.5 * 2 - 0.25 = 0.25.
    assert expected[0][3] == pytest.approx(0.25)
    assert got.tolist() == [pytest.approx(row) for row in expected]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    # Token 0 was generated already: presence penalty pushes greedy to token 1.
    tokens = sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[0]])
    assert tokens.tolist() == [1]
    # Repetition penalty via the prompt only.
    tokens = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.5)], prompts=[[0]])
    assert tokens.tolist() == [1]


def test_logit_bias_forces_token() -> None:
    torch.manual_seed(11)
    logits = torch.randn(4, 20)
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={13: 100.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    tokens = sample(logits, params)
    assert tokens[:3].tolist() == [7, 13, int(logits[2].argmax())]
    assert int(tokens[3]) != int(logits[3].argmax())


def test_allowed_token_ids_are_the_only_choices() -> None:
    torch.manual_seed(13)
    logits = torch.randn(300, 40)
    allowed = [3, 17, 38]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed)] * 100
    params += [SamplingParams(temperature=1.5, allowed_token_ids=allowed)] * 100 + [GREEDY] * 100
    tokens = sample(logits, params).tolist()
    best = [max(allowed, key=lambda t: float(logits[i, t])) for i in range(100)]
    assert tokens[:100] == best  # greedy: the argmax among the allowed ids
    assert set(tokens[100:200]) <= set(allowed) and len(set(tokens[100:200])) == 3
    assert tokens[200:] == logits[200:].argmax(-1).tolist()  # rows without the field are untouched


def test_bad_words_ban_their_last_token_after_the_rest() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 4] = 5.0  # the argmax
    logits[0, 6] = 4.0
    one = [SamplingParams(temperature=0.0, bad_words_token_ids=[[4]])]
    assert sample(logits, one, outputs=[[1, 2]]).tolist() == [6]
    two = [SamplingParams(temperature=0.0, bad_words_token_ids=[[2, 4], [9, 9, 6]])]
    assert sample(logits, two, outputs=[[1, 2]]).tolist() == [6]  # after 2, 4 would complete the word
    assert sample(logits, two, outputs=[[2, 1]]).tolist() == [4]  # not after 1
    assert sample(logits, two, outputs=[[]]).tolist() == [4]
    three = [SamplingParams(temperature=0.0, bad_words_token_ids=[[2, 4], [1, 2, 6]])]
    assert sample(logits, three, outputs=[[1, 2]]).tolist() == [0]  # both banned: the best of the rest
    # random rows never complete a word
    torch.manual_seed(14)
    rows = [SamplingParams(temperature=2.0, bad_words_token_ids=[[2, 4]])] * 400
    tokens = sample(torch.zeros(400, 10), rows, outputs=[[2]] * 400).tolist()
    assert 4 not in tokens and len(set(tokens)) == 9


def test_min_tokens_forbids_eos_then_lifts() -> None:
    eos, stop_id = 3, 5
    logits = torch.zeros(1, 8)
    logits[0, eos] = 10.0
    logits[0, stop_id] = 9.0
    logits[0, 1] = 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop_id])]
    assert sample(logits, params, outputs=[[]], eos=[eos]).tolist() == [1]
    assert sample(logits, params, outputs=[[1]], eos=[eos]).tolist() == [1]
    assert sample(logits, params, outputs=[[1, 1]], eos=[eos]).tolist() == [eos]
    # ignore_eos: eos is not forbidden, only the stop token is (and eos wins anyway).
    ignore = [SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[stop_id])]
    assert sample(logits, ignore, outputs=[[]], eos=[eos]).tolist() == [eos]
    # Random rows: eos never appears while forbidden, even though it dominates.
    torch.manual_seed(12)
    rand = [SamplingParams(temperature=1.0, min_tokens=4)] * 500
    tokens = sample(logits.expand(500, -1).contiguous(), rand, outputs=[[]] * 500, eos=[eos] * 500)
    assert eos not in tokens.tolist()


# ------------------------------------------------------------------------------------------------
# Logprobs


def _expected_rank(lp: torch.Tensor, token: int) -> int:
    return 1 + sum(1 for v in lp.tolist() if v > lp[token].item())


def test_logprobs_are_raw_and_ranked() -> None:
    torch.manual_seed(13)
    vocab = 40
    logits = torch.randn(4, vocab)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.0),
        SamplingParams(temperature=0.7, logprobs=5, logit_bias={0: 50.0}),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={9: 50.0}),
    ]
    out = make_sampler()(logits, make_md(params, vocab, outputs=[[1], [], [], []]))
    lt = out.logprobs
    assert lt is not None
    n = 5  # max over rows
    assert lt.token_ids.shape == (4, 1 + n) and lt.token_ids.dtype == torch.int64
    assert lt.logprobs.shape == (4, 1 + n) and lt.logprobs.dtype == torch.float32
    assert lt.ranks.shape == (4,) and lt.ranks.dtype == torch.int64

    # Logprobs of the RAW logits, whatever bias/penalty/temperature did to the choice.
    ref = torch.log_softmax(logits.double(), dim=-1).float()
    assert torch.equal(lt.token_ids[:, 0], out.sampled_token_ids)
    assert out.sampled_token_ids[1] == 0 and out.sampled_token_ids[3] == 9
    top_vals, top_ids = ref.topk(n, dim=-1)
    assert torch.equal(lt.token_ids[:, 1:], top_ids)
    assert torch.allclose(lt.logprobs[:, 1:], top_vals, atol=1e-5)
    for r in range(4):
        tok = int(out.sampled_token_ids[r])
        assert lt.logprobs[r, 0].item() == pytest.approx(ref[r, tok].item(), abs=1e-5)
        assert int(lt.ranks[r]) == _expected_rank(ref[r], tok)
    # The biased rows picked unlikely tokens, so their ranks are usually > 1; a greedy raw argmax has rank 1.
    assert int(lt.ranks[3]) == _expected_rank(ref[3], 9)


def test_compute_token_logprobs_for_prompt() -> None:
    torch.manual_seed(14)
    logits = torch.randn(5, 12, dtype=torch.bfloat16)
    ids = torch.tensor([0, 3, 11, 4, 4])
    lt = compute_token_logprobs(logits, ids, num_logprobs=0)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert lt.token_ids.shape == (5, 1) and lt.token_ids[:, 0].tolist() == ids.tolist()
    assert torch.allclose(lt.logprobs[:, 0], ref.gather(1, ids[:, None])[:, 0], atol=1e-6)
    assert lt.ranks.tolist() == [_expected_rank(ref[i], int(ids[i])) for i in range(5)]
    # Argmax token has rank 1; num_logprobs larger than vocab is clamped.
    top = compute_token_logprobs(logits.float(), ref.argmax(dim=-1), num_logprobs=100)
    assert top.ranks.tolist() == [1] * 5 and top.token_ids.shape == (5, 13)


def test_logprobs_tolists_msgpack_round_trip() -> None:
    torch.manual_seed(15)
    lt = compute_token_logprobs(torch.randn(3, 10), torch.tensor([1, 2, 3]), num_logprobs=2)
    lists = lt.tolists()
    assert isinstance(lists, LogprobsLists)
    assert lists.token_ids == lt.token_ids.tolist() and lists.ranks == lt.ranks.tolist()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(lists), type=LogprobsLists)
    assert decoded == lists
    assert all(isinstance(v, float) and math.isfinite(v) for row in decoded.logprobs for v in row)
    # A -inf logprob (masked vocab entry) survives the wire as well.
    masked = torch.tensor([[0.0, float("-inf")]])
    inf_lists = compute_token_logprobs(masked, torch.tensor([1]), num_logprobs=1).tolists()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(inf_lists), type=LogprobsLists)
    assert back.logprobs[0][0] == float("-inf") and back.ranks == [2]


def test_logprobs_tensors_dataclass_slots() -> None:
    lt = LogprobsTensors(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1), torch.ones(1, dtype=torch.int64))
    with pytest.raises(AttributeError):
        lt.extra = 1  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------
# Top-k / top-p against a naive per-row reference (the fast paths must agree exactly, ties included)


def _reference_keep(row: list[float], k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
    if p >= 1.0:
        return set(order)
    weights = [math.exp(row[t] - row[order[0]]) for t in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for t, w in zip(order, weights):
        if mass >= p:
            break
        kept.append(t)
        mass += w / total
    return set(kept)


@pytest.mark.parametrize("case", ["all_top_k", "mixed_top_k", "top_p_only", "top_k_only"])
def test_top_k_top_p_matches_reference(case: str) -> None:
    from pagedllm.sample.sampler import _apply_top_k_top_p

    g = gen(20)
    rows, vocab = 12, 40
    # Rounding to one decimal creates many ties, like bf16 logits do.
    logits = (torch.randn(rows, vocab, generator=g) * 2).round(decimals=1)
    ks = torch.randint(1, 12, (rows,), generator=g)
    ps = torch.rand(rows, generator=g) * 0.9 + 0.05
    if case == "mixed_top_k":
        ks[::3] = vocab
        ps[1::4] = 1.0
    if case == "top_p_only":
        ks[:] = vocab
    if case == "top_k_only":
        ps[:] = 1.0
    top_k = None if case == "top_p_only" else ks
    top_p = None if case == "top_k_only" else ps
    out = _apply_top_k_top_p(logits.clone(), top_k, top_p)
    for r in range(rows):
        expected = _reference_keep(logits[r].tolist(), int(ks[r]), float(ps[r]))
        kept = set(torch.nonzero(torch.isfinite(out[r])).flatten().tolist())
        assert kept == expected, (case, r)
        # Kept logits are unchanged.
        assert torch.equal(out[r, sorted(kept)], logits[r, sorted(kept)])
