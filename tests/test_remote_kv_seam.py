"""The scheduler's KV-connector seam (NoRemoteKV, minicore/scheduler/interfaces.py): without a
connector the Scheduler binds NoRemoteKV and its outputs carry no connector state; with one the
connector's ConnectorRemoteKV (minicore/kv_transfer/remote_kv.py), which calls the connector at
fixed points (admission, the step's metadata, finish), parks a request whose KV comes from
elsewhere until it arrives, and holds a finished request's blocks while the connector says so. A
recording connector shows the calls in order; tests/kv_transfer/test_kv_connector_scheduler.py
runs the same paths with NixlConnector."""

import pytest

from minicore.config import CacheConfig, EngineConfig
from minicore.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from minicore.kv_transfer.config import KVTransferConfig
from minicore.kv_transfer.nixl import NixlConnector
from minicore.kv_transfer.remote_kv import ConnectorRemoteKV
from minicore.request import RequestStatus
from minicore.scheduler import Scheduler
from minicore.scheduler.balance import BalanceScheduler
from minicore.scheduler.interfaces import NoRemoteKV
from minicore.scheduler.output import KVConnectorOutput
from minicore.testing import (
    fake_model_output,
    make_request,
    make_scheduler,
    num_free,
    run_until_finished,
    step,
)

# make_scheduler's pool: 64 blocks of 4 tokens, block 0 the null block.
USABLE_BLOCKS = 63


class RecordingConnector(KVConnectorBase_V1):
    """A scheduler-side connector that records every call. external: request id -> prompt tokens
    it reports as loadable from elsewhere; delay_free: what request_finished answers."""

    def __init__(self, external: dict[str, int] | None = None, delay_free: bool = False,
                 load_async: bool = True):
        super().__init__(EngineConfig(kv_transfer_config=KVTransferConfig(
            "RecordingConnector", "kv_both", kv_connector_module_path="test_remote_kv_seam")),
            KVConnectorRole.SCHEDULER)
        self.external = external or {}
        self.delay_free = delay_free
        self.load_async = load_async
        self.calls: list[tuple] = []

    def start_load_kv(self) -> None:
        raise AssertionError("a worker-side call on the scheduler's connector")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return self.external.get(request.request_id, 0), self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, blocks.get_block_ids(),
                           num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", list(scheduler_output.num_scheduled_tokens)))
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, block_ids))
        return self.delay_free, {"block_ids": block_ids}


def report(s: Scheduler, **kv_output) -> None:
    """A step whose worker side reports kv_output."""
    out = s.schedule()
    runner_output = fake_model_output(s, out)
    runner_output.kv_connector_output = KVConnectorOutput(**kv_output)
    s.update_from_output(out, runner_output)


def test_without_a_connector_the_scheduler_binds_no_remote_kv():
    s = make_scheduler()
    assert type(s.remote_kv) is NoRemoteKV and s.connector is None
    s.add_request(make_request("a", 6, max_tokens=2))
    steps = run_until_finished(s)
    assert [st.out.kv_connector_metadata for st in steps] == [None, None]
    assert [o.kv_transfer_params for st in steps for o in st.outputs] == [None, None]
    # One more step tells the runner that a finished.
    assert s.has_requests() and step(s).out.finished_req_ids == {"a"}
    assert not s.has_requests() and s.make_stats().num_deferred_waiting_reqs == 0


@pytest.mark.parametrize("cls, kwargs", [(Scheduler, {}), (BalanceScheduler, {"dp_size": 2})])
def test_with_a_connector_the_scheduler_binds_connector_remote_kv(cls, kwargs):
    connector = RecordingConnector()
    s = make_scheduler(cls=cls, connector=connector, **kwargs)
    assert type(s.remote_kv) is ConnectorRemoteKV and s.connector is connector


def test_nixl_connector_is_bound_the_same_way():
    config = EngineConfig(cache_config=CacheConfig(block_size=4, num_blocks=16),
                          kv_transfer_config=KVTransferConfig("NixlConnector", "kv_both", "P"))
    connector = NixlConnector(config, KVConnectorRole.SCHEDULER)
    s = make_scheduler(connector=connector)
    assert type(s.remote_kv) is ConnectorRemoteKV and s.connector is connector


def test_the_connector_is_called_at_admission_each_step_and_on_finish():
    connector = RecordingConnector(delay_free=True)
    s = make_scheduler(connector=connector)
    s.add_request(make_request("a", 6, max_tokens=1))
    st = step(s)
    # Matched with no local prefix hit, told its 2 blocks after admission, the step's metadata
    # built at the end of schedule(), then finished by its one token.
    assert connector.calls == [("match", "a", 0), ("alloc", "a", [1, 2], 0), ("meta", ["a"]),
                               ("finished", "a", [1, 2])]
    assert st.finished == ["a"] and st.outputs[0].kv_transfer_params == {"block_ids": [1, 2]}
    # delay_free: the blocks stay held, and the engine keeps stepping, with nothing unfinished.
    assert "a" in s.requests and num_free(s) == USABLE_BLOCKS - 2
    assert s.has_requests() and not s.has_unfinished_requests()
    # An abort of a finished request is ignored, held or not.
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.requests["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(connector.calls) == 4
    report(s, finished_sending={"a"})  # the peer has read them
    assert not s.requests and num_free(s) == USABLE_BLOCKS and not s.has_requests()
    assert connector.calls[4:] == [("meta", [])]


def test_a_request_whose_kv_comes_from_elsewhere_is_parked_until_it_arrives():
    connector = RecordingConnector(external={"r": 8})
    s = make_scheduler(connector=connector)
    s.add_request(make_request("r", 8, max_tokens=1))
    out = s.schedule()
    request = s.requests["r"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {} and num_free(s) == USABLE_BLOCKS - 2
    assert connector.calls == [("match", "r", 0), ("alloc", "r", [1, 2], 8), ("meta", [])]
    # Parked requests count as waiting (vLLM: num_requests_waiting_by_reason "deferred").
    assert s.get_request_counts() == (0, 1) and s.has_unfinished_requests()
    assert s.make_stats().num_deferred_waiting_reqs == 1
    s.update_from_output(out, fake_model_output(s, out))
    report(s, finished_recving={"r"})
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # promoted at the next step
    st = step(s)
    # Only the last prompt token is computed here, to sample from; no second match.
    assert st.scheduled == {"r": 1} and st.out.scheduled_new_reqs[0].num_computed_tokens == 7
    assert st.finished == ["r"] and num_free(s) == USABLE_BLOCKS
    assert [c[0] for c in connector.calls] == ["match", "alloc", "meta", "meta", "alloc", "meta",
                                               "finished"]


def test_a_connector_that_loads_synchronously_is_refused():
    s = make_scheduler(connector=RecordingConnector(external={"r": 8}, load_async=False))
    s.add_request(make_request("r", 8))
    with pytest.raises(NotImplementedError, match="asynchronously only"):
        s.schedule()
