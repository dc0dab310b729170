"""The NIXL side channel (the handshake listener of NixlConnectorWorker), on a stub NIXL agent (no
NIXL needed): its port is bound in the constructor, so a port in use is a ListenError naming
side_channel_port before any agent exists (end to end: tests/entrypoints/test_port_clashes.py);
it listens on side_channel_host only; whatever a peer sends, the thread answers on; and a thread
that fails anyway makes the next step raise, never leaves the engine running without it. And the
worker's READ deadline: a READ still in flight after read_timeout is cancelled and its request
recomputes; one NIXL cannot cancel keeps its blocks until a later try succeeds."""

import socket
import time

import msgspec
import psutil
import pytest
import torch
import zmq

from minicore.config import create_engine_config
from minicore.kv_transfer import nixl_worker
from minicore.kv_transfer.config import KVTransferConfig
from minicore.kv_transfer.nixl_metadata import NixlConnectorMetadata, ReqMeta
from minicore.kv_transfer.nixl_worker import GET_META_MSG, NixlAgentMetadata, NixlConnectorWorker
from minicore.ports import free_port_pair
from minicore.utils import ListenError

NUM_BLOCKS = 4


class StubAgent:
    created = 0

    def __init__(self, name: str, config: dict):
        StubAgent.created += 1

    def register_memory(self, tensors):
        return "reg"

    def prep_xfer_dlist(self, agent: str, descs, mem_type: str):
        return "dlist"

    def get_agent_metadata(self) -> bytes:
        return b"stub-agent-metadata"

    def get_new_notifs(self) -> dict:
        return {}

    def release_dlist_handle(self, dlist) -> None:
        pass

    def deregister_memory(self, descs) -> None:
        pass


@pytest.fixture(autouse=True)
def stub_nixl(monkeypatch):
    StubAgent.created = 0
    monkeypatch.setattr(nixl_worker, "_import_nixl", lambda: (StubAgent, lambda **kw: kw))


def config(port: int, dp_rank: int = 0, **extra):
    cfg = create_engine_config(
        data_parallel_size=2 if dp_rank else 1, data_parallel_rpc_port=free_port_pair(),
        kv_transfer_config=KVTransferConfig("NixlConnector", "kv_both", "engine-a",
                                            {"side_channel_port": port, **extra}))
    cfg.parallel_config.data_parallel_rank = dp_rank
    return cfg


def kv_caches() -> list[torch.Tensor]:
    return [torch.zeros(2, NUM_BLOCKS, 16, 2, 8) for _ in range(2)]


def held(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.parametrize("dp_rank,what", [(0, "the NIXL side channel"),
                                          (1, "DP rank 1's NIXL side channel")])
def test_a_port_in_use_fails_the_constructor_naming_the_setting(dp_rank, what):
    base = free_port_pair()
    with held(base + dp_rank):
        with pytest.raises(ListenError) as failed:
            NixlConnectorWorker(config(base, dp_rank))
    assert str(failed.value) == (
        f"kv_connector_extra_config.side_channel_port {base}: address localhost:{base + dp_rank} "
        f"({what}) is in use; choose another with kv_connector_extra_config.side_channel_port "
        f"in --kv-transfer-config (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT)")
    assert StubAgent.created == 0  # failed before the agent, with nothing to undo


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_it_listens_on_side_channel_host_only(host):
    port = free_port_pair()
    worker = NixlConnectorWorker(config(port, **({} if host is None else
                                                 {"side_channel_host": host})))
    try:
        assert listening_addresses(port) == {"127.0.0.1"}  # the default, localhost: loopback
    finally:
        worker.shutdown()
    assert listening_addresses(port) == set()


def handshake(port: int) -> NixlAgentMetadata:
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.RCVTIMEO, 5000)
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(GET_META_MSG)
        return msgspec.msgpack.decode(req.recv(), type=NixlAgentMetadata)
    finally:
        ctx.destroy(linger=0)


def test_the_listener_answers_on_after_anything_a_peer_sends():
    port = free_port_pair()
    worker = NixlConnectorWorker(config(port))
    worker.register_kv_caches(kv_caches())
    ctx = zmq.Context()
    try:
        # Before the fix, a message of another number of frames ended the thread (ValueError).
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        for frames in ([b"one frame"], [b"a", b"b", b"c"], [b"not empty", GET_META_MSG],
                       [b"", b"x" * 100_000]):  # the last one over the size limit: cut off
            dealer.send_multipart(frames)
        for _ in range(2):
            meta = handshake(port)
            assert (meta.engine_id, meta.num_blocks) == ("engine-a", NUM_BLOCKS)
        assert worker._listener.is_alive()
        assert worker.get_finished() == (None, None)
    finally:
        ctx.destroy(linger=0)
        worker.shutdown()


class FailingSocket:
    def recv_multipart(self):
        raise zmq.ZMQError(zmq.ENOTSOCK)


def test_a_listener_that_fails_fails_the_next_step(caplog):
    port = free_port_pair()
    worker = NixlConnectorWorker(config(port))
    real, worker._side_channel = worker._side_channel, FailingSocket()
    try:
        worker.register_kv_caches(kv_caches())
        worker._listener.join(5)
        assert not worker._listener.is_alive()
        assert f"the NIXL side channel on localhost:{port} failed" in caplog.text
        with pytest.raises(RuntimeError, match=f"NIXL side channel on localhost:{port} failed"):
            worker.get_finished()
    finally:
        worker.shutdown()
    assert real.closed


class StalledReadAgent(StubAgent):
    """A peer that never answers: every READ stays in flight; cancels fail cancel_failures times
    first."""

    def __init__(self, name: str, config: dict):
        super().__init__(name, config)
        self.released, self.cancel_failures = [], 0

    def make_prepped_xfer(self, op, local, local_ids, remote, remote_ids, notif):
        return ("read", notif)

    def transfer(self, handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle) -> str:
        return "PROC"

    def remove_remote_agent(self, name: str) -> None:
        pass

    def release_xfer_handle(self, handle) -> None:
        if self.cancel_failures:
            self.cancel_failures -= 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)


@pytest.mark.parametrize("cancel_failures", [0, 1])
def test_a_read_past_read_timeout_is_cancelled_and_its_request_recomputes(monkeypatch,
                                                                          cancel_failures):
    monkeypatch.setattr(nixl_worker, "_import_nixl",
                        lambda: (StalledReadAgent, lambda **kw: kw))
    port = free_port_pair()
    worker = NixlConnectorWorker(config(port, read_timeout=0.3))
    try:
        worker.register_kv_caches(kv_caches())
        worker.agent.cancel_failures = cancel_failures
        worker._remote["P"] = ("peer", "dlist", NUM_BLOCKS)  # as after a handshake
        worker.start_load_kv(NixlConnectorMetadata(reqs_to_recv={
            "r": ReqMeta([0, 1], [2, 3], "P", "localhost", port + 1, "remote-r")}))
        assert worker.get_finished() == (None, None)
        time.sleep(0.35)
        if cancel_failures:  # not cancelled: still in flight, its blocks still its own
            assert worker.get_finished() == (None, None)
            assert worker.get_block_ids_with_load_errors() == set()
            time.sleep(0.35)
        assert worker.get_finished() == (None, {"r"})
        assert worker.get_block_ids_with_load_errors() == {0, 1}
        assert worker.agent.released == [("read", b"remote-r")]
    finally:
        worker.shutdown()
