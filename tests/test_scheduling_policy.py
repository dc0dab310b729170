"""Scheduling policies as objects (minicore/scheduler/policies/): every module of the package is
found and registers its policy by name, with no list to edit; an unknown name is refused when the
Scheduler is built, naming the known ones; --scheduling-policy offers the registry's names; the
frontend asks the policy whether request priorities mean anything; a policy defined by
subclassing drives the scheduler's admission order and victim; the heap queue orders by its key.
The policies' sources stay pure Python (tests/test_purity.py reads minicore/scheduler/*.py)."""

import ast
from pathlib import Path

import pytest

import minicore.__main__ as cli
from minicore.config import SchedulerConfig, create_engine_config
from minicore.engine.input_processor import InputProcessor, InvalidRequestError
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.policies import SchedulingPolicy, get_policy, policy_names
from minicore.scheduler.policies.fcfs import FCFSRequestQueue
from minicore.scheduler.policies.priority import PriorityRequestQueue
from minicore.testing import make_request, make_scheduler, step

POLICIES_DIR = Path(__file__).resolve().parents[1] / "minicore" / "scheduler" / "policies"


@pytest.fixture
def registry():
    """The registry, restored after the test: a policy defined in a test leaves no trace."""
    saved = dict(SchedulingPolicy.registry)
    yield SchedulingPolicy.registry
    SchedulingPolicy.registry.clear()
    SchedulingPolicy.registry.update(saved)


def test_every_module_of_the_package_registers_its_policy():
    modules = {p.stem for p in POLICIES_DIR.glob("*.py")} - {"__init__", "base"}
    assert {get_policy(name).__module__.rsplit(".", 1)[1] for name in policy_names()} >= modules
    assert policy_names()[:2] == ["fcfs", "priority"]


def test_an_unknown_policy_is_refused_when_the_scheduler_is_built():
    assert SchedulerConfig(policy="lifo").policy == "lifo"  # config.py cannot see the registry
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'; known policies: "
                                         "fcfs, priority") as refused:
        make_scheduler(policy="lifo")
    assert str(refused.value).endswith(", ".join(policy_names()))


def test_the_cli_offers_the_registry_s_policies():
    action = next(a for a in serve_parser()._actions if a.dest == "policy")
    assert list(action.choices) == policy_names()
    for name in policy_names():
        assert cli.make_parser().parse_args(["serve", "--scheduling-policy", name]).policy == name
        assert f"{name}: {get_policy(name).description}" in action.help


def serve_parser():
    sub = next(a for a in cli.make_parser()._actions if a.choices and "serve" in a.choices)
    return sub.choices["serve"]


class Tokenizer:
    eos_token_id = 2


@pytest.mark.parametrize("policy, allowed", [("fcfs", False), ("priority", True)])
def test_a_request_priority_needs_a_policy_that_uses_it(policy, allowed):
    processor = InputProcessor(create_engine_config(scheduling_policy=policy), Tokenizer(), 100)
    processor.process_inputs("zero", [5, 6], SamplingParams())
    if allowed:
        assert processor.process_inputs("one", [5, 6], SamplingParams(), priority=1).priority == 1
    else:
        with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
            processor.process_inputs("one", [5, 6], SamplingParams(), priority=1)


def test_a_subclass_with_a_name_is_a_policy_the_scheduler_runs(registry):
    class LIFOPolicy(SchedulingPolicy):
        name = "test-lifo"
        description = "the latest arrival first, preempting the first running request"

        def create_request_queue(self):
            return PriorityRequestQueue(lambda r: (-r.arrival_time, r.request_id))

        def pick_victim(self, running):
            return running.pop(0)

    assert get_policy("test-lifo") is LIFOPolicy and "test-lifo" in policy_names()
    s = make_scheduler(policy="test-lifo", max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 3))
    assert step(s).new == ["c", "b"]
    with pytest.raises(ValueError, match="'test-lifo' is defined twice"):
        type("Again", (LIFOPolicy,), {"name": "test-lifo"})


def _request(rid: str, priority: int, arrival: float) -> Request:
    return Request(rid, [1], SamplingParams(), arrival_time=arrival, priority=priority)


def test_the_heap_queue_orders_by_its_key_and_takes_requests_back_in_order():
    q = PriorityRequestQueue(lambda r: (r.priority, r.arrival_time, r.request_id))
    a, b, c, d = _request("a", 1, 0.0), _request("b", 0, 2.0), _request("c", 0, 1.0), \
        _request("d", 0, 1.0)
    for r in (a, b, c, d):
        q.add_request(r)
    assert [r.request_id for r in q] == ["c", "d", "b", "a"] and len(q) == 4
    q.remove_request(d)
    assert q.pop_request() is c and q.peek_request() is b
    q.prepend_request(c)  # a preempted request goes where its key puts it, not first
    assert [r.request_id for r in q] == ["c", "b", "a"]


def test_the_fcfs_queue_takes_requests_back_at_the_front():
    q = FCFSRequestQueue()
    a, b, c = _request("a", 0, 0.0), _request("b", 0, 1.0), _request("c", 0, 2.0)
    for r in (a, b):
        q.add_request(r)
    q.prepend_request(c)
    assert [r.request_id for r in q] == ["c", "a", "b"] and q.peek_request() is c


def test_policy_sources_import_no_heavy_modules():
    heavy = {"torch", "zmq", "transformers"}
    found = []
    for path in POLICIES_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            found += [(path.name, n) for n in names if n.split(".")[0] in heavy]
    assert found == []
