"""Waiting queues: first-come-first-served and priority.

Mirrors vllm/v1/core/sched/request_queue.py. Both queues take preempted requests back at the front
(prepend_request); the priority queue orders by (priority, arrival_time) anyway, so for it the
front is wherever that order puts the request.
"""

import heapq
from collections import deque
from collections.abc import Iterator

from minicore.request import Request


class FCFSRequestQueue(deque):
    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_request(self, request: Request) -> None:
        self.remove(request)


class PriorityRequestQueue:
    """A heap of requests; Request.__lt__ orders by (priority, arrival_time)."""

    def __init__(self):
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
