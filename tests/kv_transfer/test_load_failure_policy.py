"""kv_load_failure_policy "fail" (vLLM's KVTransferConfig field, issue 39): a decode instance that
must not compute prompts ends a request whose KV could not be loaded with an error, where the
default ("recompute", test_kv_connector_scheduler.py and test_parked_without_a_read.py) computes it
there. The three ways a load fails: a read that failed with its report, a failure reported while
the read is still in flight (the blocks wait for it), and a read that never started. Each ends
the request alone, with an error output marked `failed` (a server error for its client), and
leaves no block behind; a request beside it runs on (the frontend's side: test_output_processor.py;
served: test_kv_transfer_params_e2e.py)."""

import time

import pytest
from test_kv_connector_scheduler import (
    NUM_BLOCKS,
    assert_empty,
    make_pd_scheduler,
    prefill,
    report,
)
from test_parked_without_a_read import NO_READ_PARAMS

from minicore.protocol import EngineCoreOutput, FinishReason
from minicore.request import RequestStatus
from minicore.testing import make_request, num_free, step

PROMPT = list(range(800, 810))  # 10 tokens: 3 blocks of 4


def decode_side_with_a_read(prompt=PROMPT):
    """A "fail" decode instance with request r parked on a real prefill's params, its read
    started, and a plain request beside it; returns (p, d, r's local block ids)."""
    p, d = make_pd_scheduler("P"), make_pd_scheduler("D", "fail")
    params = prefill(p, prompt)
    d.add_request(make_request("r", prompt, max_tokens=2, kv_transfer_params=params))
    local = d.schedule().kv_connector_metadata.reqs_to_recv["r"].local_block_ids
    d.add_request(make_request("beside", list(range(900, 906)), max_tokens=4))
    return p, d, local


def the_error(outputs: list[EngineCoreOutput], req_id: str = "r") -> EngineCoreOutput:
    (error,) = [o for o in outputs if o.request_id == req_id]
    assert error.finish_reason is FinishReason.ERROR and error.failed, error
    assert not error.new_token_ids
    assert "kv_load_failure_policy is 'fail'" in error.error_message
    return error


def finish_beside(d) -> None:
    while d.has_unfinished_requests():
        step(d)
    step(d)  # tells the runner of the last finished ids
    assert_empty(d)


@pytest.mark.parametrize("bad_block", [0, 1, 2])
def test_a_failed_read_ends_the_request_with_an_error(bad_block):
    p, d, local = decode_side_with_a_read()
    error = the_error(report(d, finished_recving={"r"}, invalid_block_ids={local[bad_block]}))
    assert f"from block {bad_block} on" in error.error_message
    assert "r" not in d.requests and "r" not in d.remote_kv.waiting_for_remote_kvs
    # Nothing of r is scheduled, ever: the plain request alone runs on.
    while d.has_unfinished_requests():
        assert set(step(d).scheduled) <= {"beside"}
    finish_beside(d)
    report(p, finished_sending={"r"})
    assert_empty(p)


def test_a_failure_reported_while_the_read_runs_ends_it_and_holds_its_blocks_until_the_read_ends():
    _, d, local = decode_side_with_a_read()
    the_error(report(d, invalid_block_ids={local[0]}))
    assert d.requests["r"].status == RequestStatus.FINISHED_ABORTED
    for _ in range(2):
        assert set(step(d).scheduled) <= {"beside"}
        assert set(d.kv_cache_manager.get_block_ids("r")) == set(local)  # still being written
    report(d, finished_recving={"r"})
    assert "r" not in d.requests
    finish_beside(d)


def test_a_read_that_never_starts_ends_the_request_at_the_deadline():
    for params in NO_READ_PARAMS:
        d = make_pd_scheduler("D", "fail")
        d.remote_kv.load_start_timeout = 0.1
        d.add_request(make_request("r", PROMPT, max_tokens=2, kv_transfer_params=dict(params)))
        parked_at = time.monotonic()
        assert step(d).scheduled == {}
        assert num_free(d) == NUM_BLOCKS - 4
        while not (outputs := step(d).outputs):
            assert time.monotonic() - parked_at < 5, "the request was never ended"
            time.sleep(0.02)
        assert time.monotonic() - parked_at >= 0.1
        assert "did not start within 0.1 s" in the_error(outputs).error_message
        step(d)
        assert_empty(d)


def test_an_abort_before_the_failure_is_reported_gets_no_error():
    _, d, local = decode_side_with_a_read()
    d.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    outputs = report(d, finished_recving={"r"}, invalid_block_ids={local[0]})
    assert all(o.request_id != "r" for o in outputs)
    finish_beside(d)

