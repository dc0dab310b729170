"""The scheduler's side of structured outputs, pure Python, with a fake grammar: a request whose
grammar compiles waits in the queue as WAITING_FOR_FSM, passed over (those behind it run) but
keeping its place, until it is ready; an abort while it compiles frees nothing because it holds
nothing; each step's output carries a bitmask row for its scheduled structured requests only; and
each matcher sees every sampled token once, in order, through preemption and resume."""

from minicore.request import RequestStatus
from minicore.scheduler.structured_output import SkipsUncompiled
from minicore.testing import FAKE_TOKEN_BASE, make_request, make_scheduler, num_free, step

T = FAKE_TOKEN_BASE


class FakeMatcher:
    def __init__(self):
        self.accepted: list[int] = []


class FakeManager(SkipsUncompiled):
    """Compiles nothing: a test says when a grammar is ready. The bitmask is the list of the
    request ids in row order (a real one is a tensor), so that tests can read it."""

    def __init__(self):
        super().__init__()
        self.compiling: set[str] = set()
        self.pending = []
        self.matchers: dict[str, FakeMatcher] = {}

    def grammar_init(self, request):
        request.status = RequestStatus.WAITING_FOR_FSM
        request.structured_output_request = FakeMatcher()
        self.compiling.add(request.request_id)

    def compiled(self, request_id):
        self.compiling.discard(request_id)

    def promote_compiled(self):
        for request in list(self.pending):
            if request.request_id not in self.compiling:
                request.status = RequestStatus.WAITING
                self.matchers[request.request_id] = request.structured_output_request
                self.pending.remove(request)

    def grammar_bitmask(self, scheduler_output, requests):
        rows = {req_id: n for n, req_id in enumerate(
            r for r in scheduler_output.num_scheduled_tokens
            if requests[r].structured_output_request is not None)}
        scheduler_output.structured_output_request_ids = rows
        scheduler_output.grammar_bitmask = list(rows)

    def accept_tokens(self, outputs, requests, proposals):
        for output in outputs:
            if (matcher := requests[output.request_id].structured_output_request) is not None:
                matcher.accepted.extend(output.new_token_ids)
        return ()  # no request to end


def scheduler_with_manager(**kwargs):
    manager = FakeManager()
    s = make_scheduler(structured_output_manager=manager, **kwargs)
    return s, manager


def add_structured(s, manager, request):
    manager.grammar_init(request)
    manager.pending.append(request)
    s.add_request(request)


def test_a_request_waits_for_its_grammar_while_those_behind_it_run_and_keeps_its_place():
    s, manager = scheduler_with_manager(max_num_seqs=3)
    add_structured(s, manager, make_request("a", 6, max_tokens=3))
    s.add_request(make_request("b", 4, max_tokens=3))
    s.add_request(make_request("c", 5, max_tokens=3))
    st = step(s)
    assert st.scheduled == {"b": 4, "c": 5}
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_FSM
    assert s.get_request_counts() == (2, 1) and s.waiting.peek_request().request_id == "a"
    assert st.out.structured_output_request_ids == {}
    s.add_request(make_request("d", 4, max_tokens=3))
    manager.compiled("a")
    st = step(s)  # one free seat: a's, since it came before d
    assert st.scheduled == {"b": 1, "c": 1, "a": 6}
    assert st.out.structured_output_request_ids == {"a": 0}
    assert st.out.grammar_bitmask == ["a"]


def test_a_compiling_request_is_passed_over_under_the_priority_policy_too():
    s, manager = scheduler_with_manager(policy="priority")
    add_structured(s, manager, make_request("a", 6, max_tokens=3, priority=-1))
    s.add_request(make_request("b", 4, max_tokens=3, priority=0))
    assert step(s).scheduled == {"b": 4}
    manager.compiled("a")
    assert step(s).scheduled == {"b": 1, "a": 6}


def test_an_abort_while_the_grammar_compiles_leaves_nothing_behind():
    s, manager = scheduler_with_manager()
    add_structured(s, manager, make_request("a", 6, max_tokens=3))
    step(s)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    manager.compiled("a")
    st = step(s)
    assert st.scheduled == {} and not s.requests and not s.waiting
    assert num_free(s) == 63
    assert st.out.finished_req_ids == {"a"}


def test_only_scheduled_structured_requests_get_bitmask_rows():
    s, manager = scheduler_with_manager(max_num_batched_tokens=8)
    s.add_request(make_request("plain", 4, max_tokens=4))
    add_structured(s, manager, make_request("a", 12, max_tokens=2))
    manager.compiled("a")
    st = step(s)  # plain's prompt and a's first chunk
    assert st.scheduled == {"plain": 4, "a": 4}
    assert st.out.structured_output_request_ids == {"a": 0}
    st = step(s)
    assert st.scheduled == {"plain": 1, "a": 7}
    assert st.out.structured_output_request_ids == {"a": 0}


def test_each_matcher_sees_every_sampled_token_once_through_preemption():
    # 6 usable blocks of 4 tokens: two growing requests preempt one another.
    s, manager = scheduler_with_manager(num_blocks=7, max_num_seqs=2)
    for name in "ab":
        add_structured(s, manager, make_request(name, 8, max_tokens=8))
        manager.compiled(name)
    preempted = False
    for _ in range(60):
        st = step(s)
        preempted |= bool(st.preempted)
        if not s.requests:
            break
    assert preempted
    assert {n: m.accepted for n, m in manager.matchers.items()} == {
        n: [T + i for i in range(8)] for n in "ab"}
