"""Scheduler unit tests: exact batch composition per step, chunked prefill, prefix hits, preemption order.

No model: a fake model runner samples a fixed token for every request that reached the end of its tokens.
"""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import FinishReason
from pagedllm.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8, policy="fcfs", caching=True, max_len=256):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len, policy=policy),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
    )


def req(rid, n_prompt, max_tokens=4, first=10, priority=0, arrival=0.0, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    r = Request(rid, list(range(first, first + n_prompt)), params, EOS, arrival_time=arrival, priority=priority)
    r.max_tokens = max_tokens
    return r


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        r = sched.requests[rid]
        ids.append(rid)
        # num_computed_tokens was already advanced by schedule(): sample when it reached the end.
        sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(ids, sampled)


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    result = sched.update_from_output(out, fake_run(sched, out, token))
    sched.kv_cache_manager.check_invariants()
    return out, result


def test_chunked_prefill_shares_steps_with_decodes():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 3))
    s.add_request(req("b", 20))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b"]
    out, _ = step(s)
    # a decodes one token, b continues its prompt with the rest of the budget
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert out.scheduled_new_reqs == [] and out.scheduled_cached_reqs.req_ids == ["a", "b"]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert {o.request_id for o in res.outputs} == {"a", "b"}


def test_finish_by_length_and_eos_frees_blocks():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 4, max_tokens=10))
    step(s)
    _, res = step(s)
    a_out = [o for o in res.outputs if o.request_id == "a"][0]
    assert a_out.finish_reason == FinishReason.LENGTH
    assert "a" not in s.requests
    _, res = step(s, token=EOS)
    assert res.outputs[0].finish_reason == FinishReason.STOP
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_blocks_in_use() == 0
    out = s.schedule()
    assert out.finished_req_ids == {"b"}


def test_stop_token_ids_and_min_tokens():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=10, stop_token_ids=[7], min_tokens=2))
    _, res = step(s)
    assert res.outputs[0].finish_reason is None  # below min_tokens
    _, res = step(s)
    assert res.outputs[0].finish_reason == FinishReason.STOP and res.outputs[0].stop_reason == 7


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, first=100 * (i + 1)))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_prefix_hit_skips_cached_tokens_but_computes_last():
    s = make_scheduler(budget=64, block_size=4)
    s.add_request(req("a", 12, max_tokens=1))
    step(s)
    assert "a" not in s.requests
    s.add_request(req("b", 12, max_tokens=1))
    out, res = step(s)
    # 12 tokens = 3 full blocks; the last token must be computed, so only 2 blocks (8 tokens) hit.
    assert out.num_scheduled_tokens == {"b": 4}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert res.outputs[0].num_cached_tokens == 8


def test_same_step_siblings_share_prompt_blocks():
    s = make_scheduler(budget=64, block_size=4)
    s.add_request(req("a", 9))
    s.add_request(req("b", 9))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}
    (a_blocks,) = out.scheduled_new_reqs[0].block_ids
    (b_blocks,) = out.scheduled_new_reqs[1].block_ids
    assert a_blocks[:2] == b_blocks[:2] and a_blocks[2] != b_blocks[2]


def test_preemption_recomputes_newest_request_fcfs():
    # 6 blocks of 4 tokens: a and b each need 2 blocks for their prompt, then grow.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12, first=50))
    step(s)  # a: blocks for 8 prompt tokens (+1 for the first sampled token is computed next step)
    preempted = None
    for _ in range(10):
        out, _ = step(s)
        if out.preempted_req_ids:
            preempted = out
            break
    assert preempted is not None
    assert preempted.preempted_req_ids == {"b"}  # the newest request is the victim
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    assert s.waiting.peek().request_id == "b"
    # b comes back and finishes with its whole output once a is done
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert out.total_num_scheduled_tokens > 0
    assert s.kv_cache_manager.num_blocks_in_use() == 0


def test_priority_policy_orders_waiting_and_picks_victim():
    s = make_scheduler(budget=64, max_seqs=1, policy="priority")
    s.add_request(req("low", 4, priority=5, arrival=1.0))
    s.add_request(req("high", 4, priority=0, arrival=2.0, first=60))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["high"]


def test_abort_frees_blocks_and_reports_to_worker():
    s = make_scheduler()
    s.add_request(req("a", 8))
    s.add_request(req("b", 8, first=40))
    step(s)
    s.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert "a" in out.finished_req_ids and list(out.num_scheduled_tokens) == ["b"]
    s.kv_cache_manager.check_invariants()


def test_priority_policy_preempts_lowest_priority_not_newest():
    # "low" runs alone first, then "high" joins: running order is [low, high], priority order the reverse.
    for policy, victim in [("fcfs", "high"), ("priority", "low")]:
        s = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False, policy=policy)
        s.add_request(req("low", 8, max_tokens=12, priority=5, arrival=1.0))
        step(s)
        s.add_request(req("high", 8, max_tokens=12, priority=0, arrival=2.0, first=50))
        preempted = set()
        while not preempted:
            out, _ = step(s)
            preempted = out.preempted_req_ids
        assert preempted == {victim}, policy
        while s.has_unfinished_requests():
            step(s)
        assert s.kv_cache_manager.num_blocks_in_use() == 0


def test_abort_running_and_waiting_requests_together():
    s = make_scheduler(max_seqs=1)
    for i, rid in enumerate("abcd"):
        s.add_request(req(rid, 4, first=20 * (i + 1)))
    step(s)
    done = s.finish_requests(["b", "d", "b", "a"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["b", "d", "a"]
    assert [r.request_id for r in s.waiting] == ["c"] and s.running == []
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b", "d"} and list(out.num_scheduled_tokens) == ["c"]
    s.kv_cache_manager.check_invariants()
