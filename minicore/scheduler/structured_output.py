"""The scheduler's side of structured outputs: the three points where it calls the manager.

Mirrors the structured-output parts of vllm/v1/core/sched/scheduler.py: a request waits in the
queue as WAITING_FOR_FSM until its grammar has compiled (promote_compiled, at the start of each
schedule(); _try_admit admits no such request), each step's output carries the grammar bitmask of
its structured requests (grammar_bitmask), and the update advances their matchers with the
tokens they sampled (accept_tokens). The manager that does the work, on xgrammar, is
StructuredOutputManager (minicore/structured_output/manager.py), bound in EngineCore; without one
(a runner without logits), NoStructuredOutput does nothing at each point. Pure Python.
"""

from minicore.protocol import EngineCoreOutput
from minicore.request import Request
from minicore.scheduler.output import SchedulerOutput


class NoStructuredOutput:
    def promote_compiled(self) -> None:
        pass

    def grammar_bitmask(self, scheduler_output: SchedulerOutput,
                        requests: dict[str, Request]) -> None:
        pass

    def accept_tokens(self, outputs: list[EngineCoreOutput],
                      requests: dict[str, Request]) -> None:
        pass


NO_STRUCTURED_OUTPUT = NoStructuredOutput()
