"""The sjf policy (minicore/scheduler/policies/sjf.py): the waiting request with the fewest tokens
to compute is admitted first (so short prompts see their first token sooner), a preempted request
rejoins the queue by what it must recompute, and the victim is the running request with the
fewest computed tokens, the latest admitted among equals. Blocks of 4 tokens; the fake model
samples 1000, 1001, ..."""

import pytest
from test_scheduling_policy import Tokenizer, serve_parser

from minicore.config import create_engine_config
from minicore.engine.input_processor import InputProcessor, InvalidRequestError
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler.policies import get_policy
from minicore.testing import make_request, make_scheduler, step


def test_sjf_is_a_policy_of_the_command_line_that_takes_no_request_priority():
    action = next(a for a in serve_parser()._actions if a.dest == "policy")
    assert "sjf" in action.choices
    processor = InputProcessor(create_engine_config(scheduling_policy="sjf"), Tokenizer(), 100)
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        processor.process_inputs("one", [5, 6], SamplingParams(), priority=1)


def test_the_shortest_waiting_request_is_admitted_first():
    s = make_scheduler(policy="sjf")
    for rid, length in (("a", 7), ("b", 3), ("c", 5), ("d", 3)):
        s.add_request(make_request(rid, length))
    st = step(s)
    assert st.new == ["b", "d", "c", "a"]  # b and d tie on 3 tokens: arrival order
    assert st.scheduled == {"b": 3, "d": 3, "c": 5, "a": 7}


@pytest.mark.parametrize("policy, first_token_step", [
    ("fcfs", {"a": 1, "b": 2, "c": 2}),
    # b and c no longer queue behind a's 12-token prefill: mean 4/3 steps instead of 5/3.
    ("sjf", {"a": 2, "b": 1, "c": 1}),
])
def test_short_prompts_get_their_first_token_sooner(policy, first_token_step):
    s = make_scheduler(policy=policy, max_num_batched_tokens=12)
    for rid, length in (("a", 12), ("b", 2), ("c", 2)):
        s.add_request(make_request(rid, length, max_tokens=4))
    first = {}
    for n in (1, 2):
        for rid in step(s).tokens:
            first.setdefault(rid, n)
    assert first == first_token_step


@pytest.mark.parametrize("policy, scheduled, preempted", [
    # fcfs: the victim is the last running request, x, the one that needs the block: the pass
    # stops after y.
    ("fcfs", {"y": 1}, {"x"}),
    # sjf: the victim is y, fewer computed tokens (5 against x's 8), although it was scheduled
    # before x in this step: it is unscheduled, and its blocks go to x.
    ("sjf", {"x": 1}, {"y"}),
])
def test_the_victim_is_the_running_request_with_the_least_work(policy, scheduled, preempted):
    # 4 usable blocks: y (3 tokens) takes 1, x (7 tokens) 2. Both decode; in the third step y
    # takes the last free block for its 5th token, and x finds none for its 9th.
    s = make_scheduler(policy=policy, num_blocks=5)
    s.add_request(make_request("y", 3))
    s.add_request(make_request("x", 7))
    assert step(s).scheduled == {"y": 3, "x": 7}
    assert step(s).scheduled == {"y": 1, "x": 1}
    st = step(s)
    assert (st.scheduled, st.preempted) == (scheduled, preempted)


def test_a_preempted_request_rejoins_the_queue_by_what_it_recomputes():
    s = make_scheduler(policy="sjf", num_blocks=5)
    s.add_request(make_request("y", 3))
    s.add_request(make_request("x", 7))
    for _ in range(3):  # y preempted in the third step (see above), with 2 outputs kept
        step(s)
    s.add_request(make_request("z", 4))
    s.add_request(make_request("w", 6))
    # y recomputes its 3 prompt tokens and 2 outputs: 5, between z's 4 and w's 6.
    assert [r.request_id for r in s.waiting] == ["z", "y", "w"]


def _running(*computed: int) -> list[Request]:
    requests = [Request(f"r{i}", [1] * 16, SamplingParams()) for i in range(len(computed))]
    for request, n in zip(requests, computed):
        request.num_computed_tokens = n
    return requests


def test_the_victim_among_equals_is_the_latest_admitted():
    sjf = get_policy("sjf")()
    running = _running(4, 2, 2, 9)
    assert sjf.pick_victim(running).request_id == "r2"
    assert [r.request_id for r in running] == ["r0", "r1", "r3"]
    assert sjf.pick_victim(running).request_id == "r1"
