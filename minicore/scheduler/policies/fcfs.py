"""fcfs: first come, first served; the victim is the last running request.

Mirrors SchedulingPolicy.FCFS of vllm/v1/core/sched/request_queue.py and the FCFS branch of the
preemption loop in vllm/v1/core/sched/scheduler.py (self.running.pop()). The default policy.
"""

from minicore.request import Request
from minicore.scheduler.policies.base import FCFSRequestQueue, SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"
    description = "arrival order, preempting the last running request"

    def create_request_queue(self) -> FCFSRequestQueue:
        return FCFSRequestQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        # The latest admitted. Running requests are scheduled in order, so it is never one
        # already scheduled in this step, unless it is the request that needs the blocks.
        return running.pop()
