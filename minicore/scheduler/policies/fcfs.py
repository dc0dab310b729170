"""fcfs: first come, first served; the victim is the last running request.

Mirrors SchedulingPolicy.FCFS and FCFSRequestQueue of vllm/v1/core/sched/request_queue.py and
the FCFS branch of the preemption loop in vllm/v1/core/sched/scheduler.py (self.running.pop()).
The default policy.
"""

from collections import deque

from minicore.request import Request
from minicore.scheduler.policies.base import RequestQueue, SchedulingPolicy


class FCFSRequestQueue(deque, RequestQueue):
    """Arrival order; a deque, so that the scheduler's per-step tests stay at C speed."""

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


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"
    description = "arrival order, preempting the last running request"

    def create_request_queue(self) -> FCFSRequestQueue:
        return FCFSRequestQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        # The latest admitted. Running requests are scheduled in order, so it is never one
        # already scheduled in this step, unless it is the request that needs the blocks.
        return running.pop()
