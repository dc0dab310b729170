"""NixlConnectorWorker's bookkeeping when a read fails mid-transfer, on a stub NIXL agent (no NIXL
needed): the request's blocks are reported invalid, and the peer is forgotten (its agent removed)
so that an instance restarted under the same engine id is handshaken afresh (found end to end:
tests/kv_transfer/test_disaggregation_e2e.py kills a prefill instance while it is read)."""

import time

from minicore.kv_transfer.nixl_worker import NixlConnectorWorker


class StubAgent:
    def __init__(self, states: dict[str, str]):
        self.states = states
        self.released: list[str] = []
        self.removed_agents: list[str] = []

    def check_xfer_state(self, handle: str) -> str:
        if self.states[handle] == "raise":
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return self.states[handle]

    def release_xfer_handle(self, handle: str) -> None:
        self.released.append(handle)

    def release_dlist_handle(self, dlist: str) -> None:
        self.released.append(dlist)

    def remove_remote_agent(self, name: str) -> None:
        self.removed_agents.append(name)


def _worker(states: dict[str, str]) -> NixlConnectorWorker:
    worker = NixlConnectorWorker.__new__(NixlConnectorWorker)  # no NIXL agent of its own
    worker.agent = StubAgent(states)
    worker._remote = {"dead": ("agent-dead", "dlist-dead", 8), "alive": ("agent-alive",
                                                                         "dlist-alive", 8)}
    deadline = time.perf_counter() + 60  # none past its read_timeout
    worker._recving = {"a": ("h-a", [3, 4], "dead", deadline), "b": ("h-b", [5], "dead", deadline),
                       "c": ("h-c", [6], "alive", deadline), "d": ("h-d", [7], "alive", deadline)}
    worker._failed_recving = set()
    worker._invalid_block_ids = set()
    return worker


def test_a_read_failed_mid_transfer_forgets_its_peer_only():
    worker = _worker({"h-a": "raise", "h-b": "ERR", "h-c": "DONE", "h-d": "PROC"})
    assert worker._get_finished_recving() == {"a", "b", "c"}
    assert worker.get_block_ids_with_load_errors() == {3, 4, 5}
    assert set(worker._remote) == {"alive"}
    assert worker.agent.removed_agents == ["agent-dead"]
    # Every finished handle was released before the dead peer's agent went.
    assert worker.agent.released == ["h-a", "h-b", "h-c", "dlist-dead"]
    assert set(worker._recving) == {"d"}
