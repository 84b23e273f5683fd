"""Unit tests for DraftPolicy: how many draft tokens a request may propose, from measured step costs and its rate.

Checks `expected_tokens` against the geometric series it stands for; the cost model (running averages, measured
lengths used as they are, interpolation between them, upward extrapolation past them, the optimistic guess with one
or none measured, lengths beyond MAX_VERIFY_ROWS ignored); `best_k` (0 when verifying costs as much per row as
decoding and the rate is low, the most drafts when a longer step costs the same, bounded by MAX_VERIFY_ROWS in a large
batch); a request for which no k pays pausing for FIRST_PAUSE steps, probing, then pausing twice as long, and a fully
accepted probe resetting the pause; `forget` dropping a request's state.
"""

from __future__ import annotations

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.policy import (
    COST_DECAY,
    FIRST_PAUSE,
    LONGEST_PAUSE,
    MAX_VERIFY_ROWS,
    PRIOR_ACCEPTANCE,
    UNMEASURED_PENALTY,
    DraftPolicy,
    expected_tokens,
)

K = 4


def policy(costs: dict[int, float] | None = None, k: int = K) -> DraftPolicy:
    p = DraftPolicy(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=3))
    for rows, seconds in (costs or {}).items():
        p.observe_step(rows, seconds)
    return p


def series(rate: float, k: int) -> float:
    """1 + rate + ... + rate^k: the token after the drafts always comes, draft i only if drafts 0..i were accepted."""
    return sum(rate**i for i in range(k + 1))


# ------------------------------------------------------------------------------------------------
# expected_tokens


def test_expected_tokens_values() -> None:
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(0.0, 0) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(1.0, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    for rate in (0.1, 0.37, 0.8, 0.999):
        for k in range(6):
            assert expected_tokens(rate, k) == pytest.approx(series(rate, k)), (rate, k)


# ------------------------------------------------------------------------------------------------
# The cost model


def test_step_cost_running_average_and_measured_lengths() -> None:
    p = policy()
    p.observe_step(3, 0.010)
    assert p.step_cost(3) == pytest.approx(0.010)
    p.observe_step(3, 0.020)
    assert p.step_cost(3) == pytest.approx(COST_DECAY * 0.010 + (1 - COST_DECAY) * 0.020)
    # Lengths outside 1..MAX_VERIFY_ROWS are not recorded.
    p.observe_step(0, 5.0)
    p.observe_step(MAX_VERIFY_ROWS + 1, 5.0)
    assert p.step_cost(MAX_VERIFY_ROWS + 1) < 1.0


def test_step_cost_interpolates_between_measured_lengths() -> None:
    p = policy({2: 0.010, 6: 0.030})
    assert p.step_cost(4) == pytest.approx(0.020)
    assert p.step_cost(3) == pytest.approx(0.015)
    # Shorter than every measured length: at most what the shortest measured one costs.
    assert p.step_cost(1) == pytest.approx(0.010)


def test_unmeasured_longer_steps_are_extrapolated_upward() -> None:
    # None measured: a guess that grows with the length.
    p = policy()
    assert p.step_cost(1) == pytest.approx(1.0)
    assert p.step_cost(5) == pytest.approx(1.0 + 4 * UNMEASURED_PENALTY)
    # One measured: UNMEASURED_PENALTY dearer per extra row than it.
    p = policy({2: 0.010})
    assert p.step_cost(4) == pytest.approx(0.010 * (1 + 2 * UNMEASURED_PENALTY))
    # Two measured, steeply: along the slope of the two longest.
    p = policy({1: 0.010, 2: 0.020, 4: 0.040})
    assert p.step_cost(8) == pytest.approx(0.040 + 4 * 0.010)
    costs = [p.step_cost(r) for r in range(4, 12)]
    assert all(b > a for a, b in zip(costs, costs[1:]))
    # Two measured, nearly flat: never flatter than UNMEASURED_PENALTY per row, so longer still costs more.
    p = policy({1: 0.010, 2: 0.010})
    assert p.step_cost(5) == pytest.approx(0.010 + 3 * UNMEASURED_PENALTY * 0.010)
    assert p.step_cost(5) > p.step_cost(2)


# ------------------------------------------------------------------------------------------------
# best_k


def test_best_k_zero_when_verify_rows_cost_like_decode_steps() -> None:
    # Each row costs as much as a whole plain step: k drafts never yield k + 1 tokens on average below rate 1.
    p = policy({r: 0.010 * r for r in range(1, 6)})
    for rate in (0.0, 0.2, 0.5, 0.9):
        assert p.best_k(rate, 1) == 0, rate
    # Expensive verification with a low rate stays off whatever the batch.
    p = policy({r: 0.010 * r for r in range(1, 33)})
    assert p.best_k(0.3, 4) == 0


def test_best_k_positive_when_verify_steps_cost_like_plain_ones() -> None:
    flat = {r: 0.010 for r in range(1, K + 2)}
    p = policy(flat)
    # Expected tokens grow with k and the step does not get longer: all K drafts.
    assert p.best_k(0.9, 1) == K
    assert p.best_k(0.5, 1) == K
    # Rate 0: drafts yield nothing, so none.
    assert p.best_k(0.0, 1) == 0


def test_best_k_bounded_by_max_verify_rows() -> None:
    p = policy({r: 0.010 for r in range(1, MAX_VERIFY_ROWS + 1)})
    half = MAX_VERIFY_ROWS // 2
    assert p.best_k(0.9, half) == 1  # k = 1 is 2 * half rows, k = 2 would be more than allowed
    assert p.best_k(0.9, half + 1) == 0
    assert p.best_k(0.9, MAX_VERIFY_ROWS // (K + 1)) == K


def test_best_k_picks_the_maximum_of_tokens_per_second() -> None:
    # Cost grows slowly: the best k depends on the rate. The choice must maximise expected tokens per second.
    costs = {r: 0.010 + 0.002 * (r - 1) for r in range(1, K + 2)}
    p = policy(costs)
    chosen = {}
    for rate in (0.3, 0.6, 0.95):
        k = p.best_k(rate, 1)
        assert 1 <= k <= K
        values = {j: expected_tokens(rate, j) / costs[j + 1] for j in range(1, K + 1)}
        assert values[k] == pytest.approx(max(values.values())), rate
        chosen[rate] = k
    assert chosen[0.3] < chosen[0.95]


# ------------------------------------------------------------------------------------------------
# num_to_propose, record, forget

# Drafts pay only at a high rate: each extra row costs 40% of a plain step.
STEEP = {r: 0.010 + 0.004 * (r - 1) for r in range(1, K + 2)}


def test_prior_rate_and_record() -> None:
    p = policy(STEEP)
    assert p.num_to_propose("a", 1) == p.best_k(PRIOR_ACCEPTANCE, 1)
    # All accepted: the rate rises and (with these costs) so does k.
    for _ in range(6):
        p.record("a", K, K)
    assert p.num_to_propose("a", 1) == K
    # Nothing verified: no change.
    p.record("a", 0, 0)
    assert p.num_to_propose("a", 1) == K


def test_request_for_which_nothing_pays_pauses_then_probes() -> None:
    p = policy(STEEP)
    assert p.best_k(0.1, 1) == 0 and p.best_k(1.0, 1) == K
    for _ in range(8):
        p.record("r", K, 0)  # rate 0.6 * 0.7^8 ~ 0.03
    # No k pays: a pause of FIRST_PAUSE steps after this one, then a probe with what would pay at full acceptance.
    proposals = [p.num_to_propose("r", 1) for _ in range(1 + FIRST_PAUSE + 1)]
    assert proposals == [0] * (1 + FIRST_PAUSE) + [K]
    # The probe is rejected: the next pause is twice as long.
    p.record("r", K, 0)
    proposals = [p.num_to_propose("r", 1) for _ in range(1 + 2 * FIRST_PAUSE + 1)]
    assert proposals == [0] * (1 + 2 * FIRST_PAUSE) + [K]
    # Other requests are not affected.
    assert p.num_to_propose("other", 1) == p.best_k(PRIOR_ACCEPTANCE, 1) > 0


def test_pause_doubles_up_to_the_longest_and_a_full_probe_resets_it() -> None:
    p = policy(STEEP)

    def pause_length() -> int:
        """Steps proposing nothing before the next proposal (the probe)."""
        n = 0
        while p.num_to_propose("r", 1) == 0:
            n += 1
            assert n <= LONGEST_PAUSE + 1
        return n

    for _ in range(8):
        p.record("r", K, 0)
    pauses = []
    for _ in range(8):
        pauses.append(pause_length())
        p.record("r", K, 0)
    expected = [min(FIRST_PAUSE * 2**i, LONGEST_PAUSE) + 1 for i in range(8)]
    assert pauses == expected
    # A probe whose drafts were all accepted resets the pause to FIRST_PAUSE (the rate is still too low to go on).
    p.record("r", K, K)
    assert p.best_k(0.3, 1) == 0
    assert pause_length() == FIRST_PAUSE + 1


def test_forget_removes_state() -> None:
    p = policy(STEEP)
    for _ in range(8):
        p.record("r", K, 0)
    assert p.num_to_propose("r", 1) == 0  # paused now
    assert p.num_to_propose("r", 1) == 0
    p.forget("r")
    # A request of the same id starts afresh: the prior rate, no pause.
    assert p.num_to_propose("r", 1) == p.best_k(PRIOR_ACCEPTANCE, 1) > 0
    p.forget("never-seen")  # unknown ids are ignored
