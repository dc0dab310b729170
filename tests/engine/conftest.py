"""Every engine test module must leave no process behind."""

import multiprocessing

import pytest


@pytest.fixture(autouse=True, scope="module")
def no_process_left_behind():
    yield
    leftovers = multiprocessing.active_children()
    for proc in leftovers:
        proc.kill()
        proc.join(5)
    assert not leftovers, f"processes left behind: {leftovers}"
