"""SchedulingPolicy, the base of every scheduling policy, and RequestQueue, the waiting queue's.

Mirrors vllm/v1/core/sched/request_queue.py (RequestQueue; the queues are in fcfs.py and
priority.py) with the victim choice of vllm/v1/core/sched/scheduler.py, which vLLM writes as
`if self.policy == SchedulingPolicy.PRIORITY` in its preemption loop. vLLM's SchedulingPolicy is
an enum of names; here it is the class a policy subclasses, holding the waiting queue's order, the
preemption victim and whether request priorities mean anything, so that a policy is one file of
minicore/scheduler/policies/ and the scheduler never tests a policy's name. A subclass with a
`name` registers itself under it. Left out: prepend_requests and remove_requests (one at a time).
"""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

from minicore.request import Request


class RequestQueue(ABC):
    """The waiting queue: iteration and peek_request give requests in admission order."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Take back a preempted request (or one whose remote KV arrived) at the front, or
        wherever the queue's order puts it."""

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class SchedulingPolicy(ABC):
    """Which waiting request is admitted first, and which running one is preempted when the KV
    cache is full. A subclass with a name is a policy of that name (--scheduling-policy NAME)."""

    # Every policy by name, filled in by __init_subclass__.
    registry: ClassVar[dict[str, type["SchedulingPolicy"]]] = {}
    name: ClassVar[str]
    # One line for --help.
    description: ClassVar[str]
    # Whether a request's priority means anything here; the frontend refuses a nonzero priority
    # otherwise (vLLM's rule), rather than ignore it silently.
    uses_priority: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        if (known := SchedulingPolicy.registry.get(cls.name)) is not None:
            raise ValueError(f"scheduling policy {cls.name!r} is defined twice: in "
                             f"{known.__module__} and in {cls.__module__}")
        SchedulingPolicy.registry[cls.name] = cls

    @abstractmethod
    def create_request_queue(self) -> RequestQueue:
        """An empty waiting queue in this policy's admission order."""

    @abstractmethod
    def pick_victim(self, running: list[Request]) -> Request:
        """Remove from running, and return, the request to preempt. It may be one the scheduler
        has already scheduled in this step (the scheduler then unschedules it), or the very request
        that needs the blocks (the running pass then stops)."""
