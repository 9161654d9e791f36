"""The scheduler's waiting queue: FCFS (a deque) or by priority (a heap), behind one interface.

Under ``priority``, a lower ``Request.priority`` is served sooner (as in vLLM); ties go to the
earlier ``arrival_time``, then to the earlier add. A preempted request keeps its key, so it goes
back ahead of everything that arrived after it at its priority.

Both queues: ``add`` (a new arrival), ``prepend`` (a preempted request, served before newer
ones), ``peek``/``pop`` (the next to admit; IndexError when empty), ``remove`` (an aborted
request; ValueError when absent), iteration in admission order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagellm.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # keeps the heap from ever comparing Requests

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                    next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # its (priority, arrival) key already puts it ahead of newer ones

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # Aborts are rare next to pushes and pops: O(n) here keeps those O(log n).
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting.")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                     f"got {policy!r}.")
