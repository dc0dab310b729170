"""sjf: shortest job first: the fewest tokens left to compute first; the victim loses least work.

Not in vLLM (whose policies are fcfs and priority); an example of a policy as one file. Admitting
the waiting request with the fewest tokens to compute (prompt, plus the outputs a preempted one
recomputes) first lowers the mean time to first token under load, since a short prompt no longer
queues behind long prefills (shortest-job-first minimises mean waiting time). The victim is the
running request with the fewest computed tokens: a preemption recomputes the least. The price is
fairness: a long prompt can wait as long as shorter ones keep arriving (no ageing here), and the
prefix cache is not consulted (a long prompt that would mostly hit it still counts as long).
"""

from minicore.request import Request
from minicore.scheduler.policies.base import SchedulingPolicy
from minicore.scheduler.policies.priority import PriorityRequestQueue


def remaining_tokens_key(request: Request) -> tuple[int, float, str]:
    # Arrival order among equals; the request id breaks exact ties.
    return (request.num_tokens - request.num_computed_tokens, request.arrival_time,
            request.request_id)


class SJFPolicy(SchedulingPolicy):
    name = "sjf"
    description = ("the waiting request with the fewest tokens to compute first, preempting the "
                   "running request with the fewest computed tokens")

    def create_request_queue(self) -> PriorityRequestQueue:
        return PriorityRequestQueue(remaining_tokens_key)

    def pick_victim(self, running: list[Request]) -> Request:
        # min keeps the first of equals: scanning from the end, ties go to the latest admitted,
        # as under fcfs.
        victim = min(reversed(running), key=lambda r: r.num_computed_tokens)
        running.remove(victim)
        return victim
