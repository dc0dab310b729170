"""NixlConnectorWorker: the worker side of NixlConnector, on a NIXL agent.

Mirrors NixlConnectorWorker in vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py
(vLLM 0.32: nixl/base_worker.py and nixl/pull_worker.py), small:
- register_kv_caches registers the paged KV cache (one tensor per layer, kv_cache_shape in
  minicore/model/kv_cache_interface.py: [2, num_blocks, block_size, heads, head_dim]) with a NIXL
  agent and describes it as 2 * num_layers regions of num_blocks blocks (MLA's cache, one latent
  row a token: num_layers regions, as vLLM's use_mla; a block is then
  block_size * (kv_lora_rank + qk_rope_head_dim) elements); it keeps the tensors referenced
  while registered (NIXL reads their memory behind torch's back).
- A handshake listener thread answers GET_META_MSG on a ZMQ ROUTER at the side channel with this
  agent's metadata and region addresses; the decode side fetches it (ZMQ REQ) the first time it
  reads from an engine, and adds the remote agent (vLLM's _nixl_handshake). The ROUTER is bound
  in the constructor, on side_channel_host only: a port in use fails the engine's startup with one
  line naming side_channel_port (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT). Should the thread fail
  later, it logs why, and the next step raises it on the forward thread: the engine fails rather
  than run on with a side channel no peer can reach.
- start_load_kv starts one READ per request, local block i from the remote request's matching
  block, with the remote request id as the notification NIXL delivers to the prefill side when
  the read completes; a request with no block to read only sends that notification.
- get_finished: reads done (or failed: their blocks reported invalid; a READ still in flight
  after read_timeout is cancelled and fails), and on the prefill side, notifications received and
  held requests whose deadline passed.
The READ is one-sided: the prefill instance's engine does nothing for it, but NIXL's progress
thread must run (with it off, a READ from an idle instance never completes). A peer that died
fails the READ (NIXL_ERR_REMOTE_DISCONNECT); its agent is then forgotten, so a restarted peer is
handshaken afresh. Left out: background handshakes (here synchronous, on the forward thread,
bounded by handshake_timeout), tensor parallelism, host buffers, block-size or layout conversion
between peers (both must match), stats.
"""

import logging
import threading
import time

import msgspec
import numpy as np
import zmq

from minicore.config import EngineConfig
from minicore.kv_transfer.nixl_metadata import (
    DEFAULT_ABORT_REQUEST_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    NixlConnectorMetadata,
    ReqMeta,
    engine_id,
    side_channel,
)
from minicore.utils import bind_zmq_socket

logger = logging.getLogger(__name__)

GET_META_MSG = b"get_meta_msg"
# Whoever reaches the side channel can send to it: a handshake is one short message and waits for
# its answer, so a peer that sends more, or more at once, is queued this little.
SIDE_CHANNEL_MAX_MSG_BYTES = 1024
SIDE_CHANNEL_HWM = 16
NIXL_MISSING = ("NIXL is not installed ({error}): NixlConnector needs it. On a CPU machine, "
                "after the CPU torch: pip install nixl-cu12==1.5.1 && pip install --no-deps "
                "nixl==1.5.1 (scripts/setup.sh does this); a plain `pip install nixl` pulls a "
                "CUDA torch")


# Microseconds between polls of NIXL's progress thread: an idle engine spends about 2% of a core on
# it instead of a whole one (docs/BENCHMARKS.md), and a READ completes at most this much later.
PROGRESS_THREAD_DELAY_US = 1000


class NixlAgentMetadata(msgspec.Struct):
    engine_id: str
    agent_metadata: bytes
    # Base address of each region (layer l's K is region 2l, its V 2l + 1).
    region_base_addrs: list[int]
    num_blocks: int
    block_len: int


def _import_nixl():
    """(agent class, config class) of NIXL's Python API, the agent with a paced progress thread."""
    try:
        from nixl import _api
    except ImportError as e:
        raise RuntimeError(NIXL_MISSING.format(error=e)) from e

    def nixl_agent(name: str, config):
        # nixl_agent hard-codes pthrDelay = 0, so its progress thread polls without pause and
        # spins a core even while the engine idles; the delay is set where the agent is made.
        make = _api.nixlBind.nixlAgent

        def paced(agent_name, agent_config):
            agent_config.pthrDelay = PROGRESS_THREAD_DELAY_US
            return make(agent_name, agent_config)

        _api.nixlBind.nixlAgent = paced
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgent = make

    return nixl_agent, _api.nixl_agent_config


class NixlConnectorWorker:
    def __init__(self, config: EngineConfig):
        nixl_agent, nixl_agent_config = _import_nixl()
        kv_config = config.kv_transfer_config
        self.engine_id = engine_id(config)
        self.side_channel_host, self.side_channel_port = side_channel(config)
        self._ctx = zmq.Context()
        self._side_channel = self._bind_side_channel(config.parallel_config.data_parallel_rank)
        self.handshake_timeout = float(kv_config.get_from_extra_config("handshake_timeout", 5.0))
        self.abort_request_timeout = float(kv_config.get_from_extra_config(
            "abort_request_timeout", DEFAULT_ABORT_REQUEST_TIMEOUT_S))
        self.read_timeout = float(kv_config.get_from_extra_config("read_timeout",
                                                                  DEFAULT_READ_TIMEOUT_S))
        backends = kv_config.get_from_extra_config("backends", ["UCX"])
        self.agent = nixl_agent(f"minicore-{self.engine_id}",
                                nixl_agent_config(enable_prog_thread=True, backends=backends))
        self.kv_caches: list = []
        self._reg_descs = None
        self._local_dlist = None
        self._metadata: NixlAgentMetadata | None = None
        # Remote engine id -> (agent name, prepared descriptor list, its num_blocks).
        self._remote: dict[str, tuple[str, object, int]] = {}
        # Reads in flight: request id -> (transfer handle, local block ids, remote engine id,
        # time.perf_counter() deadline).
        self._recving: dict[str, tuple[object, list[int], str, float]] = {}
        self._failed_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        # Held requests and their deadlines; notifications that came before the request did.
        self._reqs_to_send: dict[str, float] = {}
        self._early_notifs: dict[str, float] = {}
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._listener_error: Exception | None = None

    # ---- registration and the handshake listener -----------------------------------------------

    def _bind_side_channel(self, dp_rank: int) -> zmq.Socket:
        """The handshake listener's ROUTER, bound now, before the NIXL agent and the thread: a
        port in use fails the engine's startup here (a ListenError naming side_channel_port),
        where the thread's error would leave startup waiting for it."""
        what = f"DP rank {dp_rank}'s NIXL side channel" if dp_rank else "the NIXL side channel"
        sock = bind_zmq_socket(
            self._ctx, zmq.ROUTER, self.side_channel_host, self.side_channel_port, what,
            "kv_connector_extra_config.side_channel_port", value=self.side_channel_port - dp_rank,
            how=" in --kv-transfer-config (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT)",
            rcvhwm=SIDE_CHANNEL_HWM, sndhwm=SIDE_CHANNEL_HWM,
            max_msg_size=SIDE_CHANNEL_MAX_MSG_BYTES)
        # The thread checks for shutdown between receives.
        sock.setsockopt(zmq.RCVTIMEO, 200)
        return sock

    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = list(kv_caches)
        self._reg_descs = self.agent.register_memory(self.kv_caches)
        first = self.kv_caches[0]
        num_blocks = first.shape[1]
        block_len = first[0, 0].numel() * first.element_size()
        # A region per layer and entry: keys and values, or MLA's latent rows alone (vLLM's
        # use_mla registers one region a layer too).
        bases = [t.data_ptr() + kv * t.stride(0) * t.element_size()
                 for t in self.kv_caches for kv in range(t.shape[0])]
        self._local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descs(bases, num_blocks, block_len), "DRAM")
        self._metadata = NixlAgentMetadata(self.engine_id, self.agent.get_agent_metadata(),
                                           bases, num_blocks, block_len)
        self._listener = threading.Thread(target=self._handshake_listener, daemon=True,
                                          name="nixl_handshake_listener")
        self._listener.start()

    def _handshake_listener(self) -> None:
        """Answer each handshake with this agent's metadata until shutdown. Whoever reaches the
        port may send anything: a message not framed as a REQ's is skipped, never the thread's
        end. Any other failure is logged and kept for the forward thread (get_finished)."""
        encoded = msgspec.msgpack.encode(self._metadata)
        sock = self._side_channel
        try:
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue
                if len(frames) != 3 or frames[1]:
                    logger.warning("NIXL handshake listener skipped a message of %d frame(s)",
                                   len(frames))
                    continue
                if frames[2] != GET_META_MSG:
                    logger.warning("NIXL handshake listener got unexpected message %r",
                                   frames[2][:64])
                sock.send_multipart((frames[0], b"", encoded))
        except Exception as e:
            logger.error("the NIXL side channel on %s:%d failed, peers can no longer handshake "
                         "with this engine: %r", self.side_channel_host, self.side_channel_port,
                         e)
            self._listener_error = e

    def _handshake(self, meta: ReqMeta) -> tuple[str, object, int]:
        """Fetch the remote engine's metadata and add its agent (cached per engine id)."""
        if (remote := self._remote.get(meta.remote_engine_id)) is not None:
            return remote
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.handshake_timeout * 1000))
        try:
            sock.connect(f"tcp://{meta.remote_host}:{meta.remote_port}")
            sock.send(GET_META_MSG)
            peer = msgspec.msgpack.decode(sock.recv(), type=NixlAgentMetadata)
        except zmq.Again:  # zmq says only "Resource temporarily unavailable"
            raise TimeoutError(f"no handshake answer from {meta.remote_host}:{meta.remote_port} "
                               f"within {self.handshake_timeout} s") from None
        finally:
            sock.close()
            ctx.term()
        if peer.engine_id != meta.remote_engine_id:
            raise RuntimeError(f"{meta.remote_host}:{meta.remote_port} is engine "
                               f"{peer.engine_id!r}, not {meta.remote_engine_id!r}")
        local = self._metadata
        if (peer.block_len, len(peer.region_base_addrs)) != (local.block_len,
                                                             len(local.region_base_addrs)):
            raise RuntimeError(f"engine {peer.engine_id!r} has another KV cache layout (block of "
                               f"{peer.block_len} bytes, {len(peer.region_base_addrs)} regions; "
                               f"here {local.block_len}, {len(local.region_base_addrs)})")
        name = self.agent.add_remote_agent(peer.agent_metadata)
        dlist = self.agent.prep_xfer_dlist(
            name, _block_descs(peer.region_base_addrs, peer.num_blocks, peer.block_len), "DRAM")
        remote = self._remote[meta.remote_engine_id] = (name, dlist, peer.num_blocks)
        return remote

    def _forget_remote(self, remote_engine_id: str) -> None:
        if (remote := self._remote.pop(remote_engine_id, None)) is not None:
            name, dlist, _ = remote
            self.agent.release_dlist_handle(dlist)
            self.agent.remove_remote_agent(name)

    # ---- one step ------------------------------------------------------------------------------

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        if self._metadata is None:
            raise RuntimeError("NixlConnector needs the model's KV cache: it cannot run with "
                               "--runner simulated")
        for req_id, meta in metadata.reqs_to_recv.items():
            try:
                self._read_blocks(req_id, meta)
            except Exception as e:  # a dead or wrong peer: the request recomputes
                logger.warning("KV read for request %s from engine %s failed: %s", req_id,
                               meta.remote_engine_id, e)
                self._forget_remote(meta.remote_engine_id)
                if meta.local_block_ids:
                    self._fail(req_id, meta.local_block_ids)
        now = time.perf_counter()
        for req_id, deadline in metadata.reqs_to_send.items():
            if self._early_notifs.pop(req_id, None) is not None:
                deadline = now  # read before this engine heard of it: free at once
            self._reqs_to_send[req_id] = deadline

    def _read_blocks(self, req_id: str, meta: ReqMeta) -> None:
        name, remote_dlist, remote_num_blocks = self._handshake(meta)
        notif = meta.remote_request_id.encode()
        local_ids = meta.local_block_ids
        if not local_ids:
            self.agent.send_notif(name, notif)
            return
        # A local prefix hit covers the first blocks: read only the remote tail.
        remote_ids = meta.remote_block_ids[-len(local_ids):]
        if len(remote_ids) != len(local_ids):
            raise RuntimeError(f"{len(local_ids)} local blocks to fill from "
                               f"{len(meta.remote_block_ids)} remote ones")
        local_num_blocks = self._metadata.num_blocks
        regions = np.arange(len(self._metadata.region_base_addrs))[:, None]
        local_idx = (regions * local_num_blocks + np.asarray(local_ids)).ravel()
        remote_idx = (regions * remote_num_blocks + np.asarray(remote_ids)).ravel()
        handle = self.agent.make_prepped_xfer("READ", self._local_dlist, local_idx.tolist(),
                                              remote_dlist, remote_idx.tolist(), notif)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL could not post the READ")
        self._recving[req_id] = (handle, local_ids, meta.remote_engine_id,
                                 time.perf_counter() + self.read_timeout)

    def _fail(self, req_id: str, block_ids: list[int]) -> None:
        self._failed_recving.add(req_id)
        self._invalid_block_ids.update(block_ids)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._listener_error is not None:
            raise RuntimeError(f"the NIXL side channel on {self.side_channel_host}:"
                               f"{self.side_channel_port} failed: {self._listener_error!r}")
        return self._get_finished_sending(), self._get_finished_recving()

    def _get_finished_recving(self) -> set[str] | None:
        done = self._failed_recving
        self._failed_recving = set()
        failed_engines = set()
        now = time.perf_counter()
        for req_id, (handle, block_ids, remote_engine_id, deadline) in list(
                self._recving.items()):
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:  # NIXL raises for a peer that went away mid-transfer
                state = f"ERR: {e}"
            if state == "PROC":
                # A peer that stopped answering (its NIXL progress thread with it) leaves the
                # READ in flight for ever: past the deadline it is cancelled and the request
                # recomputes. One NIXL cannot cancel yet may still write: its blocks stay, and
                # the cancel is tried again a deadline later.
                if now < deadline or not self._cancel(req_id, handle, block_ids, remote_engine_id):
                    continue
                state = f"not done within read_timeout {self.read_timeout:g} s, cancelled"
            else:
                self.agent.release_xfer_handle(handle)
            del self._recving[req_id]
            if state != "DONE":
                logger.warning("KV read for request %s failed (%s): it recomputes", req_id, state)
                self._invalid_block_ids.update(block_ids)
                failed_engines.add(remote_engine_id)
            done.add(req_id)
        # A peer that failed mid-transfer is forgotten too, as one that failed to start (after
        # this step's handles to it are released): an instance restarted under the same engine
        # id must be handshaken afresh.
        for remote_engine_id in failed_engines:
            self._forget_remote(remote_engine_id)
        return done or None

    def _cancel(self, req_id: str, handle, block_ids: list[int], remote_engine_id: str) -> bool:
        try:
            self.agent.release_xfer_handle(handle)  # cancels a READ in flight, or raises
        except Exception as e:
            logger.warning("KV read for request %s is past read_timeout and NIXL cannot cancel "
                           "it yet (%s): trying again in %g s", req_id, e, self.read_timeout)
            self._recving[req_id] = (handle, block_ids, remote_engine_id,
                                     time.perf_counter() + self.read_timeout)
            return False
        return True

    def _get_finished_sending(self) -> set[str] | None:
        now = time.perf_counter()
        done = set()
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                req_id = msg.decode()
                if self._reqs_to_send.pop(req_id, None) is not None:
                    done.add(req_id)
                else:
                    self._early_notifs[req_id] = now
        for req_id, deadline in list(self._reqs_to_send.items()):
            if now >= deadline:
                logger.warning("Releasing the KV blocks of request %s: no peer read them in time",
                               req_id)
                del self._reqs_to_send[req_id]
                done.add(req_id)
        # A notification for a request this engine never holds (aborted here) is kept no longer
        # than a held request would be.
        self._early_notifs = {r: t for r, t in self._early_notifs.items()
                              if now - t < self.abort_request_timeout}
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def shutdown(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join()
            self._listener = None
        self._ctx.destroy(linger=0)  # closes the side channel's socket
        for handle, *_ in self._recving.values():
            self.agent.release_xfer_handle(handle)
        self._recving.clear()
        for remote_engine_id in list(self._remote):
            self._forget_remote(remote_engine_id)
        if self._local_dlist is not None:
            self.agent.release_dlist_handle(self._local_dlist)
            self.agent.deregister_memory(self._reg_descs)
            self._local_dlist = self._reg_descs = None
        self.kv_caches = []


def _block_descs(region_base_addrs: list[int], num_blocks: int, block_len: int) -> np.ndarray:
    """(address, length, device 0) of every block of every region, region-major: block b of
    region r is row r * num_blocks + b."""
    bases = np.asarray(region_base_addrs, dtype=np.int64)[:, None]
    addrs = (bases + np.arange(num_blocks, dtype=np.int64) * block_len).ravel()
    return np.stack([addrs, np.full_like(addrs, block_len), np.zeros_like(addrs)], axis=1)
