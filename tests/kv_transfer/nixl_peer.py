"""One side of the two-process NIXL read tests (tests/kv_transfer/test_nixl_read.py), run as a
script: `producer PORT ENGINE_ID` holds a request's blocks until the consumer has read them;
`consumer PORT ENGINE_ID` (the producer's) reads them and checks them byte for byte. Both fill their
KV caches from seeds only they know how to reproduce, so the consumer can compute what it must
receive. For the READ deadline: `holder PORT ENGINE_ID` holds two requests' blocks until killed;
`stalled-consumer PORT ENGINE_ID` reads the first, says "read once", waits for a line on stdin
(the test stops the holder meanwhile), then reads the second with read_timeout 2 s and says how
that read ended."""

import sys
import time

import torch

from minicore.config import EngineConfig, create_engine_config
from minicore.kv_transfer.config import KVTransferConfig
from minicore.kv_transfer.nixl_metadata import NixlConnectorMetadata, ReqMeta
from minicore.kv_transfer.nixl_worker import NixlConnectorWorker

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 12, 16, 3, 64
REMOTE_BLOCKS, LOCAL_BLOCKS = [3, 7, 1, 9], [10, 2, 5, 4]


def kv_caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g)
            for _ in range(NUM_LAYERS)]


def config(port: int, engine_id: str, **extra) -> EngineConfig:
    return create_engine_config(kv_transfer_config=KVTransferConfig(
        "NixlConnector", "kv_both", engine_id,
        {"side_channel_host": "127.0.0.1", "side_channel_port": port,
         "abort_request_timeout": 30, **extra}))


def wait_for(worker: NixlConnectorWorker, req_id: str, sending: bool) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished_sending, finished_recving = worker.get_finished()
        if req_id in ((finished_sending if sending else finished_recving) or ()):
            return
        time.sleep(0.002)
    sys.exit(f"{req_id} not finished within 30 s")


def read(worker: NixlConnectorWorker, engine_id: str, port: int, req_id: str,
         remote_req_id: str) -> float:
    """Seconds until the READ of remote_req_id's blocks ended, one way or the other."""
    meta = ReqMeta(LOCAL_BLOCKS, REMOTE_BLOCKS, engine_id, "127.0.0.1", port, remote_req_id)
    start = time.perf_counter()
    worker.start_load_kv(NixlConnectorMetadata(reqs_to_recv={req_id: meta}))
    wait_for(worker, req_id, sending=False)
    return time.perf_counter() - start


def main(role: str, port: int, engine_id: str) -> None:
    # A consumer listens for handshakes too, on the next port, under its own id.
    holds = role in ("producer", "holder")
    worker = (NixlConnectorWorker(config(port, engine_id)) if holds
              else NixlConnectorWorker(config(port + 1, engine_id + "-decode", read_timeout=2)))
    caches = kv_caches(1 if holds else 2)
    worker.register_kv_caches(caches)
    if holds:
        held = ["req-p"] if role == "producer" else ["req-p", "req-q"]
        worker.start_load_kv(NixlConnectorMetadata(
            reqs_to_send={r: time.perf_counter() + 30 for r in held}))
        print("ready", flush=True)
        if role == "holder":
            while True:  # until killed
                worker.get_finished()
                time.sleep(0.01)
        wait_for(worker, "req-p", sending=True)
    elif role == "stalled-consumer":
        read(worker, engine_id, port, "req-d1", "req-p")
        assert worker.get_block_ids_with_load_errors() == set()
        print("read once", flush=True)
        sys.stdin.readline()
        elapsed = read(worker, engine_id, port, "req-d2", "req-q")
        failed = sorted(worker.get_block_ids_with_load_errors())
        print(f"second read ended after {elapsed:.1f} s, failed blocks {failed}", flush=True)
    else:
        elapsed = read(worker, engine_id, port, "req-d", "req-p")
        assert worker.get_block_ids_with_load_errors() == set()
        expected = kv_caches(1)
        for layer, cache in enumerate(caches):
            got = cache[:, LOCAL_BLOCKS].contiguous().numpy().tobytes()
            want = expected[layer][:, REMOTE_BLOCKS].contiguous().numpy().tobytes()
            assert got == want, f"layer {layer}: the blocks differ"
        untouched = [b for b in range(NUM_BLOCKS) if b not in LOCAL_BLOCKS]
        assert torch.equal(caches[0][:, untouched], kv_caches(2)[0][:, untouched])
        print(f"equal: {len(LOCAL_BLOCKS)} blocks x {NUM_LAYERS} layers in {elapsed * 1e3:.1f} ms",
              flush=True)
    worker.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
