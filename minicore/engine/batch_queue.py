"""BatchQueue: the steps handed to the forward thread and not yet updated from, and when to wait.

Mirrors EngineCore.batch_queue of vllm/v1/engine/core.py (a deque of (future, scheduler output),
newest first) and the rule of step_with_batch_queue for when the oldest step is waited for. With
async scheduling it holds two: step N+1 is scheduled and submitted while step N runs. Its size is
the composition root's choice (minicore/engine/components.py); at 1, EngineCore.step runs and
nothing ever waits here. Left out: pipeline parallelism's deeper queue.
"""

from collections import deque
from concurrent.futures import Future

from minicore.scheduler.output import SchedulerOutput


class BatchQueue:
    def __init__(self, size: int):
        self.size = size
        self._queue: deque[tuple[Future, SchedulerOutput]] = deque()

    def has_pending(self) -> bool:
        """Whether a submitted step waits to be updated from."""
        return bool(self._queue)

    def push(self, future: Future, scheduler_output: SchedulerOutput) -> None:
        self._queue.appendleft((future, scheduler_output))

    def take_finished(self, executed: bool) -> tuple[Future, SchedulerOutput] | None:
        """The oldest step, to wait for now; None while the queue has room and the oldest still
        runs after a step that runs the model went in (executed: vLLM's rule)."""
        queue = self._queue
        if not queue or (executed and len(queue) < self.size and not queue[-1][0].done()):
            return None
        return queue.pop()
