"""A request parked for remote KV that no read will fill (issue 24): `{"do_remote_prefill": true}`
alone once parked in WAITING_FOR_REMOTE_KVS forever, and an abort kept its blocks for a read that
never started, so has_requests() stayed true. The engine now refuses such params
(test_kv_transfer_params_checks.py); these tests go around it, straight to Scheduler.add_request,
to check the scheduler's own guard: with no read in flight a parked request computes its prompt
itself after ConnectorRemoteKV.load_start_timeout, and an aborted one frees its blocks at once;
a request whose read is in flight still waits for the read, however long."""

import time

from test_kv_connector_scheduler import (
    NUM_BLOCKS,
    assert_empty,
    make_pd_scheduler,
    prefill,
    report,
)

from minicore.request import RequestStatus
from minicore.scheduler import Scheduler
from minicore.testing import make_request, num_free, step

PROMPT = list(range(700, 710))  # 10 tokens: 3 blocks of 4
NO_READ_PARAMS = [{"do_remote_prefill": True},
                  {"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "P",
                   "remote_host": "localhost", "remote_port": 7000, "remote_request_id": "r"}]


def park_without_a_read(d: Scheduler, params: dict) -> None:
    d.add_request(make_request("r", PROMPT, max_tokens=2, kv_transfer_params=params))
    out = d.schedule()
    assert d.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.kv_connector_metadata.reqs_to_recv and not out.num_scheduled_tokens
    assert not d.connector.has_load_in_flight("r")
    assert num_free(d) == NUM_BLOCKS - 4


def test_a_parked_request_with_no_read_computes_its_prompt_after_the_timeout():
    for params in NO_READ_PARAMS:
        d = make_pd_scheduler("D")
        d.remote_kv.load_start_timeout = 0.2
        parked_at = time.monotonic()
        park_without_a_read(d, dict(params))
        assert step(d).scheduled == {}  # within the timeout it waits
        while (st := step(d)).scheduled == {}:
            assert time.monotonic() - parked_at < 5, "the request never stopped waiting"
            time.sleep(0.02)
        assert time.monotonic() - parked_at >= 0.2
        # The whole prompt, here: no KV came from elsewhere.
        assert st.scheduled == {"r": 10} and st.out.scheduled_new_reqs[0].num_computed_tokens == 0
        while d.has_unfinished_requests():
            step(d)
        assert d.make_stats().num_deferred_waiting_reqs == 0
        assert_empty(d)


def test_an_aborted_request_with_no_read_frees_its_blocks_at_once():
    for params in NO_READ_PARAMS:
        d = make_pd_scheduler("D")
        park_without_a_read(d, dict(params))
        d.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        assert_empty(d)
        assert not d.remote_kv.load_deadlines


def test_a_request_whose_read_is_in_flight_waits_for_it_past_the_timeout():
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D")
    d.remote_kv.load_start_timeout = 0.0
    params = prefill(p, PROMPT)
    d.add_request(make_request("r", PROMPT, max_tokens=2, kv_transfer_params=params))
    assert "r" in d.schedule().kv_connector_metadata.reqs_to_recv
    assert d.connector.has_load_in_flight("r")
    for _ in range(3):
        assert step(d).scheduled == {}
    assert d.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    report(d, finished_recving={"r"})
    assert not d.connector.has_load_in_flight("r")
    assert step(d).scheduled == {"r": 1}  # the read's KV is used
    while d.has_unfinished_requests():
        step(d)
    assert_empty(d)
    report(p, finished_sending={"r"})
    assert_empty(p)
