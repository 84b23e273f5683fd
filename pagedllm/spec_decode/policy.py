"""DraftPolicy: how many draft tokens each request may propose, so that speculation pays for itself.

A draft costs a row of the verifying forward pass. Whether that row is nearly free depends on the machine and the
weights: on a CPU a batch-1 step of float32 or bf16 weights is bound by reading them, so a few more rows cost
little, while int8 products of a quantized model are bound by compute, and in a large batch every row is compute.
So the policy measures instead of assuming. Contract (the scheduler owns one and calls it; plain Python):
- `observe_step(num_tokens, seconds)` after each step of decodes only (with or without drafts): a running average
  of a step's duration by its number of tokens.
- `num_to_propose(req_id, batch_size)`: the most draft tokens the request may propose after this step, 0 for none.
  It picks the k in 0..num_speculative_tokens that maximises expected tokens per second for the batch: with the
  request's acceptance rate a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens for a step of batch_size * (k + 1)
  rows instead of one token for a step of batch_size rows. A step length not measured yet is interpolated between
  measured ones, or extrapolated along the slope of the longest ones measured (optimistically while only one is:
  then it gets tried once, and is known).
- `record(req_id, num_drafts, num_accepted)` after each verification updates the request's acceptance rate (an
  exponential average). A request for which no k pays (text that does not repeat) pauses for a while, twice as long
  each time, and then probes once with as many drafts as would pay were all of them accepted, so that its rate
  stays current at little cost.
- `forget(req_id)` when the request leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import SpeculativeConfig

ACCEPTANCE_DECAY = 0.7  # weight of the past in a request's acceptance rate
PRIOR_ACCEPTANCE = 0.6  # a request's rate before its first verification
COST_DECAY = 0.8  # weight of the past in a step length's duration
UNMEASURED_PENALTY = 0.05  # an unmeasured step length: this much dearer per extra row than the nearest measured
MIN_GAIN = 1.03  # drafts must promise this much more throughput than none
FIRST_PAUSE, LONGEST_PAUSE = 4, 256  # steps without proposals after drafts that did not pay
MAX_VERIFY_ROWS = 64  # a step may verify at most this many rows in all


@dataclass(slots=True)
class _Acceptance:
    rate: float = PRIOR_ACCEPTANCE
    pause: int = 0  # steps left without proposals
    next_pause: int = FIRST_PAUSE
    probe: bool = False  # the next proposal is a probe after a pause


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verification of k drafts yields when each is accepted with probability `rate` (in turn)."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self._cost: dict[int, float] = {}  # step duration (s) by its number of tokens
        self._state: dict[str, _Acceptance] = {}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if not 0 < num_tokens <= MAX_VERIFY_ROWS:
            return
        old = self._cost.get(num_tokens)
        self._cost[num_tokens] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds

    def step_cost(self, rows: int) -> float:
        """A step of `rows` tokens: measured; else interpolated between the nearest measured lengths around it; else
        extrapolated from the largest measured ones along their slope (or, with one measured, UNMEASURED_PENALTY
        dearer per row: an optimistic guess, so that the length gets tried and measured); 1.0 with none."""
        cost = self._cost.get(rows)
        if cost is not None:
            return cost
        below = sorted(r for r in self._cost if r < rows)
        above = [r for r in self._cost if r > rows]
        if below and above:
            lo, hi = below[-1], min(above)
            return self._cost[lo] + (self._cost[hi] - self._cost[lo]) * (rows - lo) / (hi - lo)
        if above:
            return self._cost[min(above)]  # a shorter step costs at most as much
        if not below:
            return 1.0 + UNMEASURED_PENALTY * (rows - 1)
        top = below[-1]
        slope = UNMEASURED_PENALTY * self._cost[top]
        if len(below) >= 2:
            prev = below[-2]
            slope = max(slope, (self._cost[top] - self._cost[prev]) / (top - prev))
        return self._cost[top] + slope * (rows - top)

    def best_k(self, rate: float, batch_size: int) -> int:
        """The number of drafts per request that maximises the batch's expected tokens per second (0: none)."""
        plain = 1.0 / self.step_cost(batch_size)
        best, best_k = plain * MIN_GAIN, 0
        for k in range(1, self.k + 1):
            rows = batch_size * (k + 1)
            if rows > MAX_VERIFY_ROWS:
                break
            value = expected_tokens(rate, k) / self.step_cost(rows)
            if value > best:
                best, best_k = value, k
        return best_k

    def num_to_propose(self, req_id: str, batch_size: int) -> int:
        state = self._state.setdefault(req_id, _Acceptance())
        if state.pause > 0:
            state.pause -= 1
            if state.pause == 0:
                state.probe = True
            return 0
        # A probe after a pause drafts as many as would pay were every draft accepted (none if even that would not).
        k = self.best_k(1.0 if state.probe else state.rate, batch_size)
        if k == 0 and not state.probe and self.best_k(1.0, batch_size) > 0:
            # Drafts would pay at this batch size, but not at this request's rate: it pauses (the batch alone is
            # no reason to: a request in a large batch drafts again as soon as the batch shrinks).
            state.pause = state.next_pause
            state.next_pause = min(2 * state.next_pause, LONGEST_PAUSE)
        return k

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        state = self._state.setdefault(req_id, _Acceptance())
        state.probe = False
        state.rate = ACCEPTANCE_DECAY * state.rate + (1 - ACCEPTANCE_DECAY) * (num_accepted / num_drafts)
        if num_accepted == num_drafts:
            state.next_pause = FIRST_PAUSE

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)
