"""One side of the two-process NIXL read test (tests/kv_transfer/test_nixl_read.py), run as a
script: `producer PORT ENGINE_ID` holds a request's blocks until the consumer has read them;
`consumer PORT ENGINE_ID` (the producer's) reads them and checks them byte for byte. Both fill their
KV caches from seeds only they know how to reproduce, so the consumer can compute what it must
receive."""

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


def config(port: int, engine_id: str) -> EngineConfig:
    return create_engine_config(kv_transfer_config=KVTransferConfig(
        "NixlConnector", "kv_both", engine_id,
        {"side_channel_host": "127.0.0.1", "side_channel_port": port,
         "abort_request_timeout": 30}))


def wait_for(worker: NixlConnectorWorker, req_id: str, sending: bool) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished_sending, finished_recving = worker.get_finished()
        if req_id in ((finished_sending if sending else finished_recving) or ()):
            return
        time.sleep(0.002)
    sys.exit(f"{req_id} not finished within 30 s")


def main(role: str, port: int, engine_id: str) -> None:
    # The consumer listens for handshakes too, on the next port, under its own id.
    worker = (NixlConnectorWorker(config(port, engine_id)) if role == "producer"
              else NixlConnectorWorker(config(port + 1, engine_id + "-decode")))
    caches = kv_caches(1 if role == "producer" else 2)
    worker.register_kv_caches(caches)
    if role == "producer":
        worker.start_load_kv(NixlConnectorMetadata(
            reqs_to_send={"req-p": time.perf_counter() + 30}))
        print("ready", flush=True)
        wait_for(worker, "req-p", sending=True)
    else:
        meta = ReqMeta(LOCAL_BLOCKS, REMOTE_BLOCKS, engine_id, "127.0.0.1", port, "req-p")
        start = time.perf_counter()
        worker.start_load_kv(NixlConnectorMetadata(reqs_to_recv={"req-d": meta}))
        wait_for(worker, "req-d", sending=False)
        elapsed = time.perf_counter() - start
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
