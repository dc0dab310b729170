"""Every engine test module must leave no process behind."""

import multiprocessing
import time

import pytest


@pytest.fixture(autouse=True, scope="module")
def no_process_left_behind():
    yield
    # A process killed at the end of the last test may not be reaped yet on a loaded machine.
    deadline = time.monotonic() + 5
    for proc in multiprocessing.active_children():
        proc.join(max(0.0, deadline - time.monotonic()))
    leftovers = multiprocessing.active_children()
    for proc in leftovers:
        proc.kill()
        proc.join(5)
    assert not leftovers, f"processes left behind: {leftovers}"
