"""The scheduler's side of structured outputs: the points where it calls the manager.

Mirrors the structured-output parts of vllm/v1/core/sched/scheduler.py: a request waits in the
queue as WAITING_FOR_FSM until its grammar has compiled (promote_compiled, at the start of each
schedule(); admission passes over such requests, which keep their place: skip_uncompiled and
restore_skipped, vLLM's skipped_waiting_requests), each step's output carries the grammar bitmask of
its structured requests (grammar_bitmask), and the update advances their matchers with the
tokens they sampled (accept_tokens). The seam is NoStructuredOutput
(minicore/scheduler/interfaces.py); here is the admission part every manager shares. The manager
that does the rest, on xgrammar, is StructuredOutputManager (minicore/structured_output/manager.py),
bound by the composition root. Pure Python.
"""


from minicore.request import Request, RequestStatus
from minicore.scheduler.interfaces import NoStructuredOutput
from minicore.scheduler.policies.base import RequestQueue


class SkipsUncompiled(NoStructuredOutput):
    """The scheduler side every grammar manager shares: admission passes over the requests whose
    grammar still compiles (WAITING_FOR_FSM), which keep their place (vLLM pops them into
    skipped_waiting_requests and puts them back after its admission loop)."""

    def __init__(self):
        self._skipped: list[Request] = []

    def skip_uncompiled(self, waiting: RequestQueue) -> bool:
        while waiting and waiting.peek_request().status is RequestStatus.WAITING_FOR_FSM:
            self._skipped.append(waiting.pop_request())
        return bool(waiting)

    def restore_skipped(self, waiting: RequestQueue) -> None:
        for request in reversed(self._skipped):
            waiting.prepend_request(request)
        self._skipped.clear()
