"""The scheduler's waiting queue: one class per scheduling policy.

Contract:
- `pop`/`peek` give the request to admit next; `__iter__` yields the waiting requests in that same order.
- `add` enqueues a new arrival; `prepend` puts back a preempted request so that it is admitted again before the
  requests that arrived after it (FCFS: at the very front; priority: its own (priority, arrival) key already
  says where it goes).
- `remove_requests` takes out requests that left while waiting (aborted), whatever their place.
- `pick_victim` is the policy's other half: of the running requests that may still be preempted this step,
  the one to preempt first (FCFS: the one admitted last; priority: the lowest priority, latest arrival; shortest:
  the longest prompt).

The scheduler only calls these methods; it never looks at the policy's name (`create_request_queue` does).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from pagedllm.core.request import Request


class RequestQueue(ABC):
    """Waiting requests in the order a scheduling policy admits them."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a request that just arrived."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put back a preempted request, ahead of the requests that arrived after it."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the request to admit next (IndexError when empty)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove these requests (each must be waiting), wherever they are in the queue."""

    @abstractmethod
    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """Of these running requests (in running order, non-empty), the one this policy preempts first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in admission order (the queue is not changed)."""

    def remove(self, request: Request) -> None:
        self.remove_requests((request,))

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque; a preempted request goes back to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)  # Requests compare and hash by identity
        if gone:
            self._queue = deque(r for r in self._queue if r not in gone)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]  # the newest in the running order

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest `priority` value first, then earliest arrival, then insertion order: a heap."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # ties on (priority, arrival) keep insertion order; never compares Requests

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) key already puts it ahead of later arrivals of its priority

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        if gone:
            self._heap = [e for e in self._heap if e[3] not in gone]
            heapq.heapify(self._heap)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class ShortestFirstRequestQueue(PriorityRequestQueue):
    """Fewest prompt tokens first, then earliest arrival: a pooling model's default (its requests finish in the step
    that computes them, so admitting the shortest first is what keeps a lone short query from waiting behind a batch
    of long documents). Preemption takes the longest."""

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.num_prompt_tokens, request.arrival_time, next(self._counter), request))

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.num_prompt_tokens, r.arrival_time))


_QUEUES: dict[str, type[RequestQueue]] = {
    "fcfs": FCFSRequestQueue,
    "priority": PriorityRequestQueue,
    "shortest": ShortestFirstRequestQueue,
}


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of a scheduling policy: "fcfs", "priority" or "shortest"."""
    cls = _QUEUES.get(policy)
    if cls is None:
        raise ValueError(f"scheduling policy must be one of {sorted(_QUEUES)}, got {policy!r}")
    return cls()
