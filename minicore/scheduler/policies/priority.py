"""priority: the smallest (priority, arrival_time) first; the victim is the largest.

Mirrors SchedulingPolicy.PRIORITY of vllm/v1/core/sched/request_queue.py (PriorityRequestQueue,
which orders by Request.__lt__) and the priority branch of the preemption loop in
vllm/v1/core/sched/scheduler.py: max(self.running, key=lambda r: (r.priority, r.arrival_time)).
"""

from minicore.request import Request
from minicore.scheduler.policies.base import PriorityRequestQueue, SchedulingPolicy


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
