"""BalanceScheduler: the admission gate driven by balance_counts (set by hand here; the DP group
assigns them in a server), for both thresholds ("full": max >= max_num_seqs; "one-short": max >=
max_num_seqs - 1), the limit's floor of 1 with one slot per rank, running requests still scheduled
while the gate is shut, and one count per DP rank. The gather itself is tested in
tests/dp/test_group.py."""

import pytest

from minicore.config import SchedulerConfig
from minicore.scheduler.balance import BalanceScheduler
from minicore.testing import make_request, make_scheduler, step


def _balance(threshold=None, dp_size=2, max_num_seqs=4):
    kw = {} if threshold is None else {"balance_threshold": threshold}
    return make_scheduler(cls=BalanceScheduler, dp_size=dp_size, max_num_seqs=max_num_seqs, **kw)


def test_default_threshold_is_full():
    assert SchedulerConfig().balance_threshold == "full"


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_one_count_per_rank(dp_size):
    s = _balance(dp_size=dp_size)
    assert s.balance_counts == [0] * dp_size


@pytest.mark.parametrize(
    "threshold, counts, admitted",
    [
        ("one-short", [0, 0], True),
        ("one-short", [2, 1], True),
        ("one-short", [3, 0], False),  # 3 >= max_num_seqs - 1
        ("one-short", [0, 3], False),
        ("one-short", [1, 4], False),
        ("full", [3, 0], True),
        ("full", [3, 3], True),
        ("full", [0, 4], False),  # 4 >= max_num_seqs
        ("full", [5, 0], False),
        (None, [3, 0], True),  # default = full
        (None, [0, 4], False),
    ],
)
def test_gate(threshold, counts, admitted):
    s = _balance(threshold)
    s.balance_counts[:] = counts
    s.add_request(make_request("a", 4))
    out = step(s).out
    if admitted:
        assert out.num_scheduled_tokens == {"a": 4}
        assert s.get_request_counts() == (1, 0)
    else:
        assert out.num_scheduled_tokens == {}
        assert s.get_request_counts() == (0, 1)
    # reopening the gate admits it
    s.balance_counts[:] = [0, 0]
    step(s)
    assert s.get_request_counts() == (1, 0)


@pytest.mark.parametrize("threshold", ["one-short", "full"])
@pytest.mark.parametrize("counts, admitted", [([0, 0], True), ([1, 0], False), ([0, 1], False)])
def test_gate_with_one_slot_per_rank(threshold, counts, admitted):
    # "one-short" means max_num_seqs - 1, a limit of 0 here: a gate shut for good without the
    # floor of 1
    s = _balance(threshold, max_num_seqs=1)
    s.balance_counts[:] = counts
    s.add_request(make_request("a", 4))
    out = step(s).out
    assert out.num_scheduled_tokens == ({"a": 4} if admitted else {})


def test_gate_is_checked_before_any_admission_not_per_request():
    # counts below the threshold: the local running count does not close the gate mid-step
    s = _balance("one-short", max_num_seqs=4)
    for rid in "abcd":
        s.add_request(make_request(rid, 2))
    out = step(s).out
    assert out.num_scheduled_tokens == {"a": 2, "b": 2, "c": 2, "d": 2}


@pytest.mark.parametrize("threshold, counts", [("one-short", [3, 0]), ("full", [0, 4])])
def test_running_requests_still_scheduled_while_gated(threshold, counts):
    s = _balance(threshold)
    s.add_request(make_request("a", 4, max_tokens=5))
    assert step(s).scheduled == {"a": 4}
    s.balance_counts[:] = counts
    s.add_request(make_request("b", 4))
    st = step(s)
    assert st.scheduled == {"a": 1}
    assert [o.request_id for o in st.outputs] == ["a"]
    assert s.get_request_counts() == (1, 1)


def test_plain_scheduler_has_no_gate():
    s = make_scheduler(max_num_seqs=4)
    s.add_request(make_request("a", 4))
    assert step(s).scheduled == {"a": 4}
