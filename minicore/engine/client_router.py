"""An engine's frontends: which one each request and utility call came from, and what each is sent.

Mirrors the client_index bookkeeping of EngineCoreProc (vllm/v1/engine/core.py: one output socket
per client, each request's outputs to the client that sent it, output_queue of (client_index,
outputs)), chosen by the composition root from the number of frontends the handshake gave the
engine. vLLM carries client_index in every request and utility call; minicore's engine knows it
from the socket a message came on, so nothing on the wire changes: a utility call's id is made
the engine's own on the way in and given back on the way out (each frontend counts its own ids).
Every frontend gets every frame, with only its own requests' outputs: the stats and the wave news
in it are the engine's, which every frontend's balancer and /metrics need (vLLM publishes them
through DPCoordinatorProc). num_received_requests is rewritten to the ADDs of that frontend the
engine has taken, which is what its balancer counts against.
"""

import itertools
from collections import deque

import msgspec

from minicore.protocol import EngineCoreOutputs, EngineCoreRequestType


class OneClient:
    """One frontend (every engine but those of `serve --api-server-count N`): messages as they
    came, frames as they are."""

    def on_input(self, client: int, request_type: EngineCoreRequestType, payload):
        return request_type, payload

    def on_add(self, client: int, request_id: str) -> None:
        """Nothing to remember: every output goes to the one frontend."""

    def route(self, frame: EngineCoreOutputs) -> tuple[tuple[int, EngineCoreOutputs], ...]:
        return ((0, frame),)


class ClientRouter:
    """Several frontends: each request's outputs to the frontend that sent it, each utility result
    to its caller, the rest of every frame to all."""

    def __init__(self, num_clients: int):
        self.num_clients = num_clients
        self.owners: dict[str, int] = {}
        # The engine's call id -> (frontend, its call id).
        self.calls: dict[int, tuple[int, int]] = {}
        self._call_ids = itertools.count()
        # The frontend of each ADD (refused ones too) in arrival order, until the engine has
        # taken it: the engine counts them in that order.
        self._adds: deque[int] = deque()
        self._num_taken = 0
        self.num_received = [0] * num_clients

    def on_input(self, client: int, request_type: EngineCoreRequestType, payload):
        if request_type is EngineCoreRequestType.ADD:
            self.on_add(client, payload.request_id)
        elif request_type is EngineCoreRequestType.ABORT:
            for request_id in payload:
                if self.owners.get(request_id) == client:
                    del self.owners[request_id]
        elif request_type is EngineCoreRequestType.UTILITY:
            call_id, method, args = payload
            engine_call_id = next(self._call_ids)
            self.calls[engine_call_id] = (client, call_id)
            payload = (engine_call_id, method, args)
        return request_type, payload

    def on_add(self, client: int, request_id: str) -> None:
        self.owners[request_id] = client
        self._adds.append(client)

    def route(self, frame: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        while self._num_taken < frame.num_received_requests:
            self.num_received[self._adds.popleft()] += 1
            self._num_taken += 1
        outputs = [[] for _ in range(self.num_clients)]
        for output in frame.outputs:
            # None: its frontend aborted it after this step began; no one waits for it.
            client = (self.owners.pop(output.request_id, None) if output.finished
                      else self.owners.get(output.request_id))
            if client is not None:
                outputs[client].append(output)
        caller = None
        if (result := frame.utility_output) is not None:
            caller, result.call_id = self.calls.pop(result.call_id)
        return [(client, msgspec.structs.replace(
            frame, outputs=outputs[client], num_received_requests=self.num_received[client],
            utility_output=result if client == caller else None))
            for client in range(self.num_clients)]


def make_client_router(num_clients: int) -> OneClient | ClientRouter:
    return OneClient() if num_clients == 1 else ClientRouter(num_clients)
