"""Waiting-queue unit tests: admission order, preempted requests put back, removal, and the victim each policy
picks. The scheduler relies on these and never branches on the policy name.
"""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request
from pagedllm.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from pagedllm.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), None, arrival_time=arrival, priority=priority)


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: RequestQueue) -> list[str]:
    out = []
    while queue:
        assert queue.peek() is next(iter(queue))
        out.append(queue.pop().request_id)
    return out


def test_create_request_queue_by_policy() -> None:
    assert type(create_request_queue("fcfs")) is FCFSRequestQueue
    assert type(create_request_queue("priority")) is PriorityRequestQueue
    with pytest.raises(ValueError, match="'lottery'"):
        create_request_queue("lottery")


def test_fcfs_order_prepend_and_remove() -> None:
    q = FCFSRequestQueue()
    assert len(q) == 0 and not q and list(q) == []
    reqs = {rid: req(rid) for rid in "abcde"}
    for r in reqs.values():
        q.add(r)
    assert len(q) == 5 and ids(q) == list("abcde")
    assert q.pop() is reqs["a"]
    q.prepend(reqs["a"])  # preempted: back at the very front
    q.remove_requests([reqs["c"], reqs["e"]])
    q.remove(reqs["b"])
    q.remove_requests([])
    assert ids(q) == ["a", "d"] and len(q) == 2
    assert drain(q) == ["a", "d"]
    with pytest.raises(IndexError):
        q.peek()


def test_priority_order_is_priority_then_arrival_then_insertion() -> None:
    q = PriorityRequestQueue()
    for r in [req("a", 1, 0.0), req("b", 0, 5.0), req("c", 0, 1.0), req("d", 1, 0.0), req("e", -1, 9.0)]:
        q.add(r)
    # Iteration shows the admission order and leaves the queue as it was.
    assert ids(q) == ["e", "c", "b", "a", "d"] and len(q) == 5
    assert drain(q) == ["e", "c", "b", "a", "d"]


def test_priority_prepend_returns_by_key_and_remove_keeps_heap() -> None:
    q = PriorityRequestQueue()
    late = req("late", 0, 5.0)
    early = req("early", 0, 1.0)
    low = req("low", 3, 0.0)
    for r in [late, low]:
        q.add(r)
    q.prepend(early)  # a preempted request that arrived first is admitted before later arrivals of its priority
    assert ids(q) == ["early", "late", "low"]
    q.remove(late)
    q.add(req("mid", 1, 2.0))
    assert drain(q) == ["early", "mid", "low"]


@pytest.mark.parametrize(
    ("queue", "victim"),
    [(FCFSRequestQueue(), "new"), (PriorityRequestQueue(), "worst")],
    ids=["fcfs", "priority"],
)
def test_pick_victim(queue: RequestQueue, victim: str) -> None:
    # Running order: admission order, which under preemption need not follow priority.
    running = [req("worst", 9, 0.0), req("tie-early", 2, 1.0), req("tie-late", 2, 3.0), req("new", 0, 4.0)]
    assert queue.pick_victim(running).request_id == victim
    assert queue.pick_victim(running[1:3]).request_id == "tie-late"


def test_shortest_first_admits_fewest_prompt_tokens_then_earliest() -> None:
    def make(rid: str, n: int, arrival: float) -> Request:
        return Request(rid, list(range(n)), SamplingParams(max_tokens=1), None, arrival_time=arrival)

    queue = create_request_queue("shortest")
    reqs = [make("long", 90, 0.0), make("mid", 40, 1.0), make("short-late", 9, 3.0), make("short", 9, 2.0)]
    for r in reqs:
        queue.add(r)
    assert [r.request_id for r in queue] == ["short", "short-late", "mid", "long"]
    assert queue.pick_victim(reqs).request_id == "long"
    queue.remove(reqs[1])
    assert [queue.pop().request_id for _ in range(len(queue))] == ["short", "short-late", "long"]
