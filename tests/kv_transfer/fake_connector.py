"""FakeNixlConnector: NixlConnector's real scheduler side with a worker side that moves no bytes,
for scheduler and engine tests without NIXL (as vLLM's tests/v1/kv_connector/unit fake NIXL's
wrapper). Reads complete at the next get_finished; held blocks are released when a read's
notification arrives (FakeNixlWorker.notify, which a test calls for the peer) or at their
deadline. Named in a kv_transfer_config as kv_connector "FakeNixlConnector" with
kv_connector_module_path "fake_connector"."""

import time

from minicore.kv_transfer.base import KVConnectorRole
from minicore.kv_transfer.nixl import NixlConnector
from minicore.kv_transfer.nixl_metadata import NixlConnectorMetadata


class FakeNixlWorker:
    def __init__(self):
        self.reqs_to_send: dict[str, float] = {}
        self.notified: set[str] = set()
        self.reads_done: set[str] = set()
        # Every read started: request id -> its ReqMeta (notify-only ones included).
        self.reads: dict = {}

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        self.reqs_to_send.update(metadata.reqs_to_send)
        for req_id, meta in metadata.reqs_to_recv.items():
            self.reads[req_id] = meta
            if meta.local_block_ids:
                self.reads_done.add(req_id)

    def notify(self, req_id: str) -> None:
        self.notified.add(req_id)

    def get_finished(self):
        now = time.perf_counter()
        sending = {r for r, deadline in self.reqs_to_send.items()
                   if r in self.notified or now >= deadline}
        for r in sending:
            del self.reqs_to_send[r]
        recving, self.reads_done = self.reads_done, set()
        return sending or None, recving or None


class FakeNixlConnector(NixlConnector):
    def __init__(self, config, role):
        if role == KVConnectorRole.WORKER:
            super(NixlConnector, self).__init__(config, role)
            self.connector_scheduler = None
            self.connector_worker = FakeNixlWorker()
        else:
            super().__init__(config, role)

    def register_kv_caches(self, kv_caches) -> None:
        """No bytes to move."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        """Nothing to release."""
