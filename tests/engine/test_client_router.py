"""An engine with several frontends (ClientRouter): each request's outputs go to the frontend that
sent it, each utility result to its caller under the caller's own call id, the stats and wave news
to all, and each frontend is told how many of its own ADDs the engine has taken."""

from minicore.engine.client_router import ClientRouter, OneClient, make_client_router
from minicore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
)

ADD, ABORT, UTILITY = (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT,
                       EngineCoreRequestType.UTILITY)


class Add:
    """What on_input reads of an EngineCoreRequest."""

    def __init__(self, request_id: str):
        self.request_id = request_id


def frame(*outputs, received: int = 0, **fields) -> EngineCoreOutputs:
    return EngineCoreOutputs(1, list(outputs), SchedulerStats(num_running_reqs=3), 5.0,
                             num_received_requests=received, **fields)


def token(request_id: str, finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [7], FinishReason.LENGTH if finished else None)


def test_one_frontend_is_passed_through():
    router = make_client_router(1)
    assert isinstance(router, OneClient)
    sent = frame(token("a"), received=4)
    assert router.route(sent) == ((0, sent),)
    assert router.on_input(0, ABORT, ["a"]) == (ABORT, ["a"])


def test_outputs_go_to_the_frontend_that_sent_the_request():
    router = make_client_router(2)
    assert isinstance(router, ClientRouter)
    router.on_input(0, ADD, Add("a"))
    router.on_input(1, ADD, Add("b"))
    routed = dict(router.route(frame(token("a"), token("b"), received=2, wave_complete=3)))
    assert [o.request_id for o in routed[0].outputs] == ["a"]
    assert [o.request_id for o in routed[1].outputs] == ["b"]
    for client in (0, 1):  # the engine's state, to every frontend
        assert routed[client].scheduler_stats.num_running_reqs == 3
        assert routed[client].wave_complete == 3
        assert routed[client].engine_index == 1
        assert routed[client].num_received_requests == 1
    # A finished request is forgotten; a later frame has nothing of it for anyone.
    router.route(frame(token("a", finished=True), received=2))
    routed = dict(router.route(frame(token("a"), received=2)))
    assert routed[0].outputs == routed[1].outputs == []
    assert "a" not in router.owners


def test_a_frontend_abort_drops_the_request_outputs_still_in_flight():
    router = ClientRouter(2)
    router.on_input(1, ADD, Add("a"))
    router.on_input(0, ABORT, ["a"])  # another frontend's abort of the same id changes nothing
    assert router.owners == {"a": 1}
    router.on_input(1, ABORT, ["a"])
    routed = dict(router.route(frame(token("a", finished=True), received=1)))
    assert routed[0].outputs == routed[1].outputs == []
    assert router.owners == {}


def test_each_frontend_counts_only_its_own_adds_the_engine_has_taken():
    router = ClientRouter(2)
    for client, request_id in ((0, "a"), (1, "b"), (1, "c"), (0, "d")):
        router.on_input(client, ADD, Add(request_id))
    # The engine has taken the first three ADDs, in arrival order.
    routed = dict(router.route(frame(received=3)))
    assert routed[0].num_received_requests == 1
    assert routed[1].num_received_requests == 2
    router.on_add(0, "refused")  # an ADD that did not decode counts too
    routed = dict(router.route(frame(received=5)))
    assert [routed[c].num_received_requests for c in (0, 1)] == [3, 2]


def test_utility_calls_get_engine_ids_and_their_results_go_back_to_the_caller():
    router = ClientRouter(3)
    # Two frontends count their call ids from 0: the engine must tell the calls apart.
    _, (id_a, method, args) = router.on_input(0, UTILITY, (0, "ping", []))
    _, (id_b, _, _) = router.on_input(2, UTILITY, (0, "sleep", [1]))
    assert (method, args) == ("ping", []) and id_a != id_b
    routed = dict(router.route(frame(utility_output=UtilityOutput(id_b, result="ok"))))
    assert routed[2].utility_output == UtilityOutput(0, result="ok")
    assert routed[0].utility_output is None and routed[1].utility_output is None
    routed = dict(router.route(frame(utility_output=UtilityOutput(id_a))))
    assert routed[0].utility_output.call_id == 0
    assert routed[2].utility_output is None
    assert router.calls == {}
