"""Scheduler unit tests for speculative decoding, and SpeculativeConfig.from_value parsing.

No model: fake ModelRunnerOutputs return, for a request with scheduled drafts, the accepted ones and one more token,
and propose drafts through `spec_token_ids`. Checks that drafts are scheduled after the request's last token and
counted in its tokens; that rejected drafts are taken back out of `num_computed_tokens` exactly; that drafts never
take a request past max_tokens, max_model_len or the step's token budget; that a stop token or EOS among the returned
tokens finishes the request and drops what follows; that preemption clears drafts; that the SpecDecodingStats
reported count drafts, draft tokens, accepted tokens and acceptances per position; that the draft policy is fed; and,
over many random accept/reject rounds with preemptions, that the KV cache invariants hold every step and every block
is free at the end. Then `SpeculativeConfig.from_value`: JSON text and dicts, defaults of the lookup window, and the
ValueError (naming the problem) of each kind of bad value.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutputs, FinishReason, SpecDecodingStats
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.policy import DraftPolicy

EOS = 2
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=8, caching=True, max_len=256, spec=SPEC):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        speculative_config=spec,
    )


def req(rid, n_prompt, max_tokens=16, first=10, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    r = Request(rid, list(range(first, first + n_prompt)), params, EOS)
    r.max_tokens = max_tokens
    return r


def samples(sched: Scheduler, rid: str) -> bool:
    """Whether the request reaches the end of its known tokens in the step just scheduled."""
    r = sched.requests[rid]
    return r.num_computed_tokens >= r.num_tokens


def run(
    sched: Scheduler,
    out: SchedulerOutput,
    tokens: dict[str, list[int]] | None = None,
    accept: dict[str, int] | None = None,
    propose: dict[str, list[int]] | None = None,
    bonus: int = 7,
) -> ModelRunnerOutput:
    """A fake model runner. A sampling request gets `tokens[rid]` if given, else its first `accept[rid]` (default:
    all) scheduled drafts and `bonus`; `propose` gives the drafts proposed after the step."""
    tokens, accept = tokens or {}, accept or {}
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        ids.append(rid)
        if rid in tokens:
            sampled.append(tokens[rid])
        elif samples(sched, rid):
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            sampled.append(drafts[: accept.get(rid, len(drafts))] + [bonus])
        else:
            sampled.append([])
    return ModelRunnerOutput(ids, sampled, spec_token_ids=dict(propose or {}))


def step(sched: Scheduler, **kw) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    out = sched.schedule()
    result = sched.update_from_output(out, run(sched, out, **kw))
    sched.kv_cache_manager.check_invariants()
    return out, result


def output_of(result: EngineCoreOutputs, rid: str):
    [o] = [o for o in result.outputs if o.request_id == rid]
    return o


def prefill_with_drafts(sched: Scheduler, rid: str, drafts: list[int], n_prompt: int = 6, **kw) -> Request:
    """Add a request, run its prompt in one step (it samples one token) and give it drafts."""
    r = req(rid, n_prompt, **kw)
    sched.add_request(r)
    out, _ = step(sched, propose={rid: drafts})
    assert out.num_scheduled_tokens[rid] == n_prompt
    assert r.spec_token_ids == drafts
    assert r.num_computed_tokens == r.num_tokens - 1
    return r


# ------------------------------------------------------------------------------------------------
# Scheduling drafts


def test_drafts_are_scheduled_after_the_last_token() -> None:
    s = make_scheduler(block_size=4)
    r = prefill_with_drafts(s, "a", [21, 22, 23])
    assert r.num_tokens == 7
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    assert out.num_scheduled_tokens == {"a": 4} and out.total_num_scheduled_tokens == 4
    assert out.scheduled_cached_reqs.num_computed_tokens == [6]
    # The last known token and the three drafts are computed this step: slots for 10 tokens, 3 blocks of 4.
    assert r.num_computed_tokens == 10
    assert len(s.kv_cache_manager.get_blocks("a")) == 3
    # The drafts are taken: a draft is verified once.
    assert r.spec_token_ids == []
    # The policy may ask a for drafts after this step (how many depends on measured timings), never for more than
    # num_speculative_tokens.
    assert set(out.num_spec_tokens_to_propose) <= {"a"}
    assert all(1 <= k <= SPEC.num_speculative_tokens for k in out.num_spec_tokens_to_propose.values())


def test_no_drafts_no_spec_tokens_and_one_token() -> None:
    s = make_scheduler()
    prefill_with_drafts(s, "a", [])
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"a": 1}


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_rejected_drafts_are_taken_back(accepted: int) -> None:
    s = make_scheduler(block_size=4)
    r = prefill_with_drafts(s, "a", [21, 22, 23])
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, accept={"a": accepted}, bonus=40, propose={"a": [31, 32]}))
    s.kv_cache_manager.check_invariants()
    got = output_of(res, "a").new_token_ids
    assert got == [21, 22, 23][:accepted] + [40]
    assert r.output_token_ids == [7] + got
    assert r.num_tokens == 7 + accepted + 1
    assert r.num_computed_tokens == r.num_tokens - 1
    # The KV slots of rejected drafts stay allocated; the next step computes exactly the last token and new drafts.
    assert len(s.kv_cache_manager.get_blocks("a")) == 3
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [31, 32]}
    assert out.scheduled_cached_reqs.num_computed_tokens == [r.num_tokens - 1]
    assert out.num_scheduled_tokens == {"a": 3}
    assert r.num_computed_tokens == r.num_tokens + 2
    s.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("accepted, max_tokens", [(3, 5), (1, 16), (0, 16)])
def test_blocks_filled_by_accepted_drafts_are_cached(accepted: int, max_tokens: int) -> None:
    """The blocks accepted drafts fill go to the prefix cache as soon as they are verified (3 accepted: also when
    that verification finishes the request). A block full of known tokens whose last slot still holds a rejected
    draft's keys (none accepted: the token after the rejection sits there, not computed yet) is not cached."""
    s = make_scheduler(block_size=4)
    r = prefill_with_drafts(s, "a", [21, 22, 23], max_tokens=max_tokens)  # 6 prompt tokens and one output
    out, _ = step(s, accept={"a": accepted})  # positions 6 .. 9: the output and three drafts
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 23]} and r.num_tokens == 8 + accepted
    assert (r.status == RequestStatus.FINISHED_LENGTH_CAPPED) == (accepted + 2 == max_tokens)
    probe = Request("b", r.all_token_ids[: 8 + accepted] + [99, 98], SamplingParams(temperature=0), EOS)
    _, hit = s.kv_cache_manager.get_computed_blocks(probe)
    # computed: the prompt, the first output and the accepted drafts (the last token's KV is not yet)
    assert hit == (7 + accepted) // 4 * 4


def test_a_request_still_in_its_prompt_gets_no_drafts() -> None:
    # The fake runner hands drafts to a request whose prompt is chunked: they are not scheduled with its chunk.
    s = make_scheduler(budget=4)
    r = req("a", 10)
    s.add_request(r)
    step(s, propose={"a": [1, 2, 3]})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {}
    assert r.spec_token_ids == []


# ------------------------------------------------------------------------------------------------
# Limits: max_tokens, max_model_len, budget


def test_drafts_truncated_at_max_tokens() -> None:
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [21, 22, 23], max_tokens=3)  # one output already
    out = s.schedule()
    # Two more outputs allowed: one draft and the token after it.
    assert out.scheduled_spec_decode_tokens == {"a": [21]}
    assert out.num_scheduled_tokens == {"a": 2}
    _ = s.update_from_output(out, run(s, out))
    assert r.output_token_ids == [7, 21, 7]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "a" not in s.requests and s.kv_cache_manager.num_blocks_in_use() == 0


def test_no_drafts_for_the_last_token() -> None:
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [21, 22, 23], max_tokens=2)
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"a": 1}
    res = s.update_from_output(out, run(s, out))
    assert output_of(res, "a").finish_reason == FinishReason.LENGTH
    assert r.num_output_tokens == 2


def test_extra_returned_tokens_never_exceed_max_tokens() -> None:
    # A runner returning more tokens than a request may still output: the ones past max_tokens are dropped.
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [], max_tokens=3)
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, tokens={"a": [50, 51, 52, 53]}))
    o = output_of(res, "a")
    assert o.new_token_ids == [50, 51] and o.finish_reason == FinishReason.LENGTH
    assert r.output_token_ids == [7, 50, 51]
    assert s.kv_cache_manager.num_blocks_in_use() == 0


def test_extra_tokens_after_truncated_drafts_never_exceed_max_tokens() -> None:
    # The runner ignores the truncation and returns all the drafts it proposed, accepted, and one more (more than
    # the scheduled drafts + 1, which the real runner never does): only the verified ones count.
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [21, 22, 23], max_tokens=3)
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [21]}
    res = s.update_from_output(out, run(s, out, tokens={"a": [21, 22, 23, 40]}))
    o = output_of(res, "a")
    assert o.new_token_ids == [21, 22] and o.finish_reason == FinishReason.LENGTH
    assert r.num_output_tokens == 3
    assert s.kv_cache_manager.num_blocks_in_use() == 0


def test_drafts_truncated_at_max_model_len() -> None:
    s = make_scheduler(max_len=10, block_size=4)
    r = prefill_with_drafts(s, "a", [21, 22, 23], max_tokens=100)
    assert r.num_tokens == 7
    out = s.schedule()
    # 10 tokens at most: the token after the drafts is the 10th, so 2 drafts; the KV never passes position 9.
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22]}
    assert r.num_computed_tokens == 9 <= s.max_model_len
    assert len(s.kv_cache_manager.get_blocks("a")) * 4 >= 9
    res = s.update_from_output(out, run(s, out))
    o = output_of(res, "a")
    assert o.new_token_ids == [21, 22, 7] and o.finish_reason == FinishReason.LENGTH
    assert r.num_tokens == 10


def test_budget_truncates_drafts() -> None:
    s = make_scheduler(budget=6)
    a, b, c = req("a", 2), req("b", 2, first=30), req("c", 2, first=50)
    for r in (a, b, c):
        s.add_request(r)
    out, _ = step(s, propose={"a": [21, 22, 23], "b": [31, 32, 33], "c": [41, 42, 43]})
    assert out.num_scheduled_tokens == {"a": 2, "b": 2, "c": 2}
    out = s.schedule()
    # Every running request's own token comes first: a takes 1 + 3 (two tokens stay for b and c), b and c one each.
    assert out.num_scheduled_tokens == {"a": 4, "b": 1, "c": 1}
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    assert out.total_num_scheduled_tokens == 6
    s.update_from_output(out, run(s, out))
    for r in (a, b, c):
        assert r.num_computed_tokens == r.num_tokens - 1
    # b's and c's drafts were dropped (a draft is verified once or never), so nothing is scheduled after them.
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_drafts_leave_a_block_for_every_later_request() -> None:
    """Drafts never take the blocks the running requests after them need for their own token (no preemption)."""
    s = make_scheduler(budget=64)
    a, b = req("a", 2), req("b", 2, first=30)
    for r in (a, b):
        s.add_request(r)
    step(s, propose={"a": [21, 22, 23]})
    manager = s.kv_cache_manager
    # Leave exactly the blocks b needs for its next token: a's drafts would need one more.
    spare = manager.get_num_free_blocks() - manager.num_new_blocks(b, 1)
    taken = manager.block_pool.get_new_blocks(spare - manager.num_new_blocks(a, 1)) if spare > 0 else []
    out = s.schedule()
    assert manager.num_new_blocks(a, 4) > manager.num_new_blocks(a, 1)  # the drafts would need a block
    assert out.preempted_req_ids == set()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.scheduled_spec_decode_tokens == {}
    manager.block_pool.free_blocks(taken)


def test_budget_of_one_token_schedules_no_drafts() -> None:
    s = make_scheduler(budget=1)
    r = req("a", 1)
    s.add_request(r)
    step(s, propose={"a": [5, 6]})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_decode_tokens == {}


# ------------------------------------------------------------------------------------------------
# Stop conditions inside the returned tokens


def test_eos_among_accepted_drafts_finishes_and_drops_the_rest() -> None:
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [21, EOS, 23])
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, propose={"a": [1, 2]}))
    o = output_of(res, "a")
    assert o.new_token_ids == [21, EOS]
    assert o.finish_reason == FinishReason.STOP
    assert r.output_token_ids == [7, 21, EOS]
    assert "a" not in s.requests and s.kv_cache_manager.num_blocks_in_use() == 0
    assert "a" in s.schedule().finished_req_ids


def test_stop_token_in_the_middle_sets_stop_reason() -> None:
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [21, 22, 23], stop_token_ids=[22])
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, accept={"a": 1}, bonus=22))
    o = output_of(res, "a")
    assert o.new_token_ids == [21, 22]
    assert o.finish_reason == FinishReason.STOP and o.stop_reason == 22
    assert r.num_output_tokens == 3


def test_eos_before_min_tokens_does_not_stop() -> None:
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [EOS, 22, EOS], min_tokens=3)
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, bonus=40))
    o = output_of(res, "a")
    # The first EOS is the 2nd output (below min_tokens), the second EOS the 4th: it stops there, 40 is dropped.
    assert o.new_token_ids == [EOS, 22, EOS] and o.finish_reason == FinishReason.STOP
    assert r.output_token_ids == [7, EOS, 22, EOS]


def test_ignore_eos() -> None:
    s = make_scheduler()
    r = prefill_with_drafts(s, "a", [EOS, EOS], ignore_eos=True)
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, bonus=EOS))
    assert output_of(res, "a").finish_reason is None
    assert r.output_token_ids == [7, EOS, EOS, EOS]
    assert r.num_computed_tokens == r.num_tokens - 1


# ------------------------------------------------------------------------------------------------
# Preemption


def test_preemption_clears_drafts() -> None:
    # 4 blocks of 4 tokens: a and b hold 2 each after their prompts; a's next token needs a third block.
    s = make_scheduler(num_blocks=4, block_size=4, caching=False)
    a, b = req("a", 8, max_tokens=6), req("b", 8, max_tokens=6, first=50)
    s.add_request(a)
    s.add_request(b)
    step(s, propose={"a": [1, 2, 3], "b": [4, 5, 6]})
    assert a.spec_token_ids == [1, 2, 3] and b.spec_token_ids == [4, 5, 6]
    out = s.schedule()
    assert out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == [] and b.num_computed_tokens == 0
    # a decodes plainly: no room for its drafts without preempting another.
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"a": 1}
    s.update_from_output(out, run(s, out, propose={"a": [9], "b": [9]}))
    assert b.spec_token_ids == []  # not in the step: what the runner says about it is ignored
    s.kv_cache_manager.check_invariants()
    # b resumes with a recompute (no drafts) and both finish with all their tokens.
    resumed = False
    while s.has_unfinished_requests():
        out, _ = step(s, propose={"a": [1, 2], "b": [3, 4]})
        cached = out.scheduled_cached_reqs
        if dict(zip(cached.req_ids, cached.resumed_from_preemption)).get("b"):
            resumed = True
            assert "b" not in out.scheduled_spec_decode_tokens and out.num_scheduled_tokens["b"] > 1
    assert resumed
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert s.kv_cache_manager.num_blocks_in_use() == 0


def test_random_accept_reject_rounds_keep_invariants() -> None:
    rng = random.Random(1234)
    s = make_scheduler(num_blocks=14, block_size=4, budget=24, max_seqs=6, caching=True, max_len=64)
    expected: dict[str, list[int]] = {}
    limits: dict[str, int] = {}
    reqs: dict[str, Request] = {}
    totals = SpecDecodingStats()
    reported = SpecDecodingStats(num_accepted_tokens_per_pos=[0, 0, 0])
    for i in range(10):
        rid = f"r{i}"
        # Shared leading tokens between some prompts: prefix-cache hits too.
        prompt_len = rng.randint(3, 14)
        r = req(rid, prompt_len, max_tokens=rng.randint(4, 30), first=100 if i % 2 else 10 * i)
        reqs[rid], expected[rid], limits[rid] = r, [], r.max_tokens
        s.add_request(r)
    preemptions = steps = 0
    while s.has_unfinished_requests():
        steps += 1
        assert steps < 1000
        out = s.schedule()
        preemptions += len(out.preempted_req_ids)
        for rid in out.preempted_req_ids:
            assert reqs[rid].spec_token_ids == []
        ids, sampled, before = [], [], {}
        for rid, n in out.num_scheduled_tokens.items():
            r = reqs[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            assert n >= 1 + len(drafts)
            assert r.num_computed_tokens <= s.max_model_len
            # Drafts never let a request pass max_tokens or max_model_len.
            assert r.num_output_tokens + len(drafts) + 1 <= r.max_tokens
            assert r.num_tokens + len(drafts) + 1 <= s.max_model_len
            ids.append(rid)
            before[rid] = r.num_tokens
            if samples(s, rid):
                accepted = rng.randint(0, len(drafts))
                new = drafts[:accepted] + [rng.randint(3, 99)]
                if drafts:
                    totals.num_drafts += 1
                    totals.num_draft_tokens += len(drafts)
                    totals.num_accepted_tokens += accepted
                    for k in range(accepted):
                        reported.num_accepted_tokens_per_pos[k] += 1
            else:
                assert not drafts
                new = []
            sampled.append(new)
        propose = {rid: [rng.randint(3, 99) for _ in range(rng.randint(1, 3))] for rid in ids if rng.random() < 0.8}
        result = s.update_from_output(out, ModelRunnerOutput(ids, sampled, spec_token_ids=propose))
        s.kv_cache_manager.check_invariants()
        stats = result.scheduler_stats.spec_decoding_stats
        reported.num_drafts += stats.num_drafts
        reported.num_draft_tokens += stats.num_draft_tokens
        reported.num_accepted_tokens += stats.num_accepted_tokens
        for rid, new in zip(ids, sampled):
            r = reqs[rid]
            expected[rid].extend(new[: limits[rid] - len(expected[rid])])
            if new and rid in s.requests:
                # Sampled and still running: everything but its last token is computed.
                assert r.num_computed_tokens == r.num_tokens - 1 == before[rid] + len(new) - 1
    assert preemptions > 0
    for rid, r in reqs.items():
        assert r.output_token_ids == expected[rid]
        assert r.num_output_tokens == limits[rid]
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv_cache_manager.num_blocks_in_use() == 0
    assert totals.num_drafts > 20
    assert (reported.num_drafts, reported.num_draft_tokens, reported.num_accepted_tokens) == (
        totals.num_drafts,
        totals.num_draft_tokens,
        totals.num_accepted_tokens,
    )
    t = s.total_spec_stats
    assert (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens) == (
        totals.num_drafts,
        totals.num_draft_tokens,
        totals.num_accepted_tokens,
    )
    assert t.num_accepted_tokens_per_pos == reported.num_accepted_tokens_per_pos


# ------------------------------------------------------------------------------------------------
# Stats and the draft policy


def test_spec_decoding_stats_per_step() -> None:
    s = make_scheduler(budget=64)
    for rid, first in (("a", 10), ("b", 30), ("c", 70)):
        s.add_request(req(rid, 5, first=first))
    step(s, propose={"a": [21, 22, 23], "b": [31, 32]})
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 23], "b": [31, 32]}
    res = s.update_from_output(out, run(s, out, accept={"a": 2, "b": 0}, propose={"a": [1]}))
    stats = res.scheduler_stats.spec_decoding_stats
    assert stats == SpecDecodingStats(
        num_drafts=2, num_draft_tokens=5, num_accepted_tokens=2, num_accepted_tokens_per_pos=[1, 1, 0]
    )
    out = s.schedule()
    res = s.update_from_output(out, run(s, out, accept={"a": 1}))
    # Reset at each report: only this step's verification.
    assert res.scheduler_stats.spec_decoding_stats == SpecDecodingStats(
        num_drafts=1, num_draft_tokens=1, num_accepted_tokens=1, num_accepted_tokens_per_pos=[1]
    )
    out = s.schedule()
    res = s.update_from_output(out, run(s, out))
    assert res.scheduler_stats.spec_decoding_stats == SpecDecodingStats()
    # Since the start.
    assert s.total_spec_stats == SpecDecodingStats(
        num_drafts=3, num_draft_tokens=6, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0]
    )


def test_no_spec_stats_without_speculative_config() -> None:
    s = make_scheduler(spec=None)
    s.add_request(req("a", 4))
    out, res = step(s, propose={"a": [1, 2]})
    assert res.scheduler_stats.spec_decoding_stats is None
    assert out.num_spec_tokens_to_propose == {}
    assert s.draft_policy is None


class RecordingPolicy(DraftPolicy):
    """A DraftPolicy that always asks for 2 drafts and records what the scheduler tells it."""

    def __init__(self) -> None:
        super().__init__(SPEC)
        self.calls: list[tuple] = []

    def num_to_propose(self, req_id: str, batch_size: int) -> int:
        self.calls.append(("propose", req_id, batch_size))
        return 2

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.calls.append(("record", req_id, num_drafts, num_accepted))

    def forget(self, req_id: str) -> None:
        self.calls.append(("forget", req_id))


def test_scheduler_feeds_the_draft_policy() -> None:
    s = make_scheduler(budget=8)
    policy = RecordingPolicy()
    s.draft_policy = policy
    s.add_request(req("a", 3, max_tokens=4))
    s.add_request(req("b", 10, first=50))
    out, _ = step(s, propose={"a": [21, 22]})
    # a sampled (batch of 2 requests); b's prompt is not done: nothing to propose for it.
    assert out.num_spec_tokens_to_propose == {"a": 2}
    assert policy.calls == [("propose", "a", 2)]
    policy.calls.clear()
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22]}
    assert out.num_spec_tokens_to_propose == {"a": 2, "b": 2}
    s.update_from_output(out, run(s, out, accept={"a": 1}))
    assert ("record", "a", 2, 1) in policy.calls
    policy.calls.clear()
    out, _ = step(s)  # a's 4th token: it finishes
    assert ("forget", "a") in policy.calls
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert ("forget", "b") in policy.calls


# ------------------------------------------------------------------------------------------------
# SpeculativeConfig.from_value


def test_from_value_json_and_dict() -> None:
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert SpeculativeConfig.from_value(text) == want
    assert (
        SpeculativeConfig.from_value(
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        )
        == want
    )
    assert SpeculativeConfig.from_value(None) is None
    assert SpeculativeConfig.from_value("") is None
    assert SpeculativeConfig.from_value({}) is None
    assert SpeculativeConfig.from_value("{}") is None


def test_from_value_lookup_window_defaults() -> None:
    def window(**kw) -> tuple[int, int]:
        cfg = SpeculativeConfig.from_value({"num_speculative_tokens": 2, **kw})
        assert cfg is not None and cfg.method == "ngram" and cfg.num_speculative_tokens == 2
        return cfg.prompt_lookup_min, cfg.prompt_lookup_max

    assert window() == (5, 5)
    assert window(prompt_lookup_max=7) == (7, 7)
    assert window(prompt_lookup_min=3) == (3, 3)
    assert window(prompt_lookup_min=2, prompt_lookup_max=9) == (2, 9)
    assert window(prompt_lookup_min=None, prompt_lookup_max=4) == (4, 4)  # null is the same as absent


@pytest.mark.parametrize(
    "value,words",
    [
        ({"num_speculative_tokens": 3, "draft_model": "x"}, ["unknown", "draft_model"]),
        ({"num_speculative_tokens": 3, "method": "eagle"}, ["method", "eagle"]),
        ({"num_speculative_tokens": 0}, ["num_speculative_tokens", "positive"]),
        ({"num_speculative_tokens": -2}, ["num_speculative_tokens", "-2"]),
        ({"num_speculative_tokens": "3"}, ["num_speculative_tokens"]),
        ({"num_speculative_tokens": 2.5}, ["num_speculative_tokens"]),
        ({"num_speculative_tokens": True}, ["num_speculative_tokens"]),
        ({"num_speculative_tokens": 3, "prompt_lookup_max": 0}, ["prompt_lookup_max", "positive"]),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": -1}, ["prompt_lookup_min", "positive"]),
        ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, ["prompt_lookup_min", "(4)"]),
        ({"method": "ngram"}, ["num_speculative_tokens"]),
        ('{"num_speculative_tokens": 3,', ["JSON"]),
        ("ngram", ["JSON"]),
        ("[1, 2]", ["JSON object"]),
        ('{"num_speculative_tokens": 3, "method": "medusa"}', ["method", "medusa"]),
    ],
)
def test_from_value_errors_name_the_problem(value, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_value(value)
    message = str(err.value)
    assert "speculative_config" in message
    for word in words:
        assert word in message, (word, message)
