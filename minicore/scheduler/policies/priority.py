"""priority: the smallest (priority, arrival_time) first; the victim is the largest.

Mirrors SchedulingPolicy.PRIORITY of vllm/v1/core/sched/request_queue.py (PriorityRequestQueue,
which orders by Request.__lt__) and the priority branch of the preemption loop in
vllm/v1/core/sched/scheduler.py: max(self.running, key=lambda r: (r.priority, r.arrival_time)).
"""

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from minicore.request import Request
from minicore.scheduler.policies.base import RequestQueue, SchedulingPolicy


class PriorityRequestQueue(RequestQueue):
    """A heap of requests, smallest key(request) first. The key is taken when a request joins, and
    must end with something unique to the request (its id), so that no two keys tie. vLLM's orders
    by Request.__lt__, (priority, arrival_time); here the priority policy passes that key."""

    def __init__(self, key: Callable[[Request], tuple[Any, ...]]):
        self._key = key
        self._heap: list[tuple[tuple[Any, ...], Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

    # The order decides where a request taken back goes.
    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove_request(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap))


def priority_key(request: Request) -> tuple[int, float, str]:
    # The request id breaks exact ties, as vLLM's Request.__lt__ does.
    return request.priority, request.arrival_time, request.request_id


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    description = ("the smallest request priority first, then arrival order, preempting the "
                   "largest (priority, arrival)")
    uses_priority = True

    def create_request_queue(self) -> PriorityRequestQueue:
        return PriorityRequestQueue(priority_key)

    def pick_victim(self, running: list[Request]) -> Request:
        # The first of the worst, wherever it is in running (vLLM: max, no request-id tie-break).
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
        running.remove(victim)
        return victim
