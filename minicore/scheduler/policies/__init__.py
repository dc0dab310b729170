"""Scheduling policies by name: the waiting queue's order and the preemption victim, as one object.

Mirrors vllm/v1/core/sched/request_queue.py (SchedulingPolicy, create_request_queue): see base.py.
Every module of this package is imported with it, and a SchedulingPolicy subclass with a name
registers itself, so a new policy is one new file here (plus its tests), with no list to edit:
the scheduler builds it by name, --scheduling-policy lists it, the frontend asks it whether
request priorities mean anything.
"""

import importlib
import pkgutil

from minicore.scheduler.policies.base import RequestQueue, SchedulingPolicy

__all__ = ["RequestQueue", "SchedulingPolicy", "get_policy", "policy_names"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def policy_names() -> list[str]:
    return list(SchedulingPolicy.registry)


def get_policy(name: str) -> type[SchedulingPolicy]:
    """The policy class of that name; ValueError naming the known ones if there is none."""
    if (policy := SchedulingPolicy.registry.get(name)) is None:
        raise ValueError(f"unknown scheduling policy {name!r}; known policies: "
                         f"{', '.join(policy_names())}")
    return policy
