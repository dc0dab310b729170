"""Data parallelism without processes: the frontend's DPCoordinator (engine choice by
4 * waiting + running, requests in flight counted as waiting, waves and START_DP_WAVE), the
X-data-parallel-rank header's parsing, and the DP config and CLI checks that refuse a setup which
could only hang or misroute later. Pure logic, so every case is cheap to pin down here."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from minicore.config import create_engine_config
from minicore.dp.coordinator import DPCoordinator
from minicore.entrypoints.openai_protocol import OpenAIError
from minicore.entrypoints.serving import OpenAIServing
from minicore.ports import free_port
from minicore.protocol import EngineCoreOutputs, SchedulerStats

CLI_TIMEOUT_S = 60


# ------------------------------------------------------------------ engine choice


def _frame(engine: int, waiting: int = 0, running: int = 0, received: int = 0, **wave):
    return EngineCoreOutputs(engine_index=engine,
                             scheduler_stats=SchedulerStats(num_running_reqs=running,
                                                            num_waiting_reqs=waiting),
                             num_received_requests=received, **wave)


def test_least_loaded_engine_weighs_waiting_four_times_running():
    coord = DPCoordinator(2)
    assert coord.on_outputs(_frame(0, waiting=0, running=3)) is None
    assert coord.on_outputs(_frame(1, waiting=1, running=0)) is None
    # Scores 3 and 4: three running requests are less load than one waiting.
    assert coord.select_engine() == 0


def test_explicit_rank_wins_over_load():
    coord = DPCoordinator(2)
    coord.on_outputs(_frame(1, waiting=5, running=8))
    assert coord.select_engine(1) == 1
    assert coord.num_sent == [0, 1]


def test_requests_sent_count_as_waiting_until_the_engine_received_them():
    coord = DPCoordinator(2)
    # A burst: engine 0 has not answered yet, so its idle stats do not show these two.
    assert [coord.select_engine(0), coord.select_engine(0)] == [0, 0]
    assert coord.select_engine() == 1
    # Engine 0 took both and runs them (score 2); engine 1's one is still in flight (score 4).
    coord.on_outputs(_frame(0, running=2, received=2))
    assert coord.select_engine() == 0
    # Engine 1's frame says it received its request: it weighs as running only, while engine
    # 0's third is in flight (2 running + 4 * 1).
    coord.on_outputs(_frame(1, running=1, received=1))
    assert (coord.score(0), coord.score(1)) == (6, 1)
    assert coord.select_engine() == 1


def test_ties_go_to_the_lowest_index():
    coord = DPCoordinator(3)
    assert coord.select_engine() == 0
    coord = DPCoordinator(3)
    coord.on_outputs(_frame(0, running=2))
    coord.on_outputs(_frame(1, running=1))
    coord.on_outputs(_frame(2, running=1))
    assert coord.select_engine() == 1


def test_frames_without_stats_keep_the_counts():
    coord = DPCoordinator(2)
    coord.on_outputs(_frame(0, running=3))
    coord.on_outputs(EngineCoreOutputs(engine_index=0))
    assert coord.num_running == [3, 0]
    assert coord.select_engine() == 1


# ------------------------------------------------------------------ waves


def test_a_request_starts_a_wave_only_while_paused():
    coord = DPCoordinator(2)
    assert coord.on_request_sent(1) == (0, 1)  # wake the others, engine 1 wakes itself
    assert coord.engines_running
    assert coord.on_request_sent(0) is None
    assert coord.on_request_sent(1) is None


def test_wave_complete_advances_and_pauses_and_a_stale_one_is_ignored():
    coord = DPCoordinator(2)
    coord.on_request_sent(0)
    assert coord.on_outputs(EngineCoreOutputs(engine_index=0, wave_complete=0)) is None
    assert (coord.current_wave, coord.engines_running) == (1, False)
    assert coord.on_request_sent(1) == (1, 1)
    # A late report of wave 0 must not pause wave 1.
    assert coord.on_outputs(EngineCoreOutputs(engine_index=0, wave_complete=0)) is None
    assert (coord.current_wave, coord.engines_running) == (1, True)
    assert coord.on_request_sent(0) is None


def test_start_wave_request_from_an_engine():
    coord = DPCoordinator(2)
    coord.on_request_sent(0)
    coord.on_outputs(EngineCoreOutputs(engine_index=0, wave_complete=0))
    # Paused at wave 1: engine 1 got a request for it and asks for the others to be woken.
    assert coord.on_outputs(EngineCoreOutputs(engine_index=1, start_wave=1)) == (1, 1)
    assert coord.engines_running
    # Already running: no second START.
    assert coord.on_outputs(EngineCoreOutputs(engine_index=0, start_wave=1)) is None
    # An older wave changes nothing.
    assert coord.on_outputs(EngineCoreOutputs(engine_index=0, start_wave=0)) is None
    assert (coord.current_wave, coord.engines_running) == (1, True)
    # A newer wave is adopted even while running.
    assert coord.on_outputs(EngineCoreOutputs(engine_index=0, start_wave=4)) == (4, 0)
    assert (coord.current_wave, coord.engines_running) == (4, True)


def test_wave_news_and_stats_in_one_frame():
    coord = DPCoordinator(2)
    coord.on_request_sent(0)
    coord.on_outputs(_frame(0, running=0, wave_complete=0))
    assert (coord.current_wave, coord.engines_running) == (1, False)
    assert coord.num_running == [0, 0]


# ------------------------------------------------------------------ X-data-parallel-rank


@pytest.fixture
def serving():
    client = SimpleNamespace(tokenizer=None, vocab_size=100, num_engines=2,
                             config=create_engine_config(data_parallel_size=2))
    return OpenAIServing(client, ["m"])


@pytest.mark.parametrize("header", ["x", "-1", "2", "1.0", ""])
def test_bad_rank_header_is_a_400_naming_it(serving, header):
    with pytest.raises(OpenAIError) as e:
        serving._data_parallel_rank(header)
    assert (e.value.status, e.value.param) == (400, "X-data-parallel-rank")
    assert "[0, 2)" in e.value.message


def test_rank_header_parses(serving):
    assert serving._data_parallel_rank(None) is None
    assert serving._data_parallel_rank("0") == 0
    assert serving._data_parallel_rank("1") == 1


# ------------------------------------------------------------------ config and CLI


def test_balance_scheduling_needs_data_parallelism():
    with pytest.raises(ValueError, match="data_parallel_size >= 2"):
        create_engine_config(balance_scheduling=True)
    assert create_engine_config(balance_scheduling=True,
                                data_parallel_size=2).scheduler_config.balance_scheduling


@pytest.mark.parametrize("kwargs", [
    {"data_parallel_size": 0},
    {"data_parallel_size": 2, "data_parallel_size_local": 3},
    {"data_parallel_size": 2, "data_parallel_size_local": -1},
    {"data_parallel_size": 2, "data_parallel_start_rank": 2},
    {"data_parallel_size": 2, "data_parallel_start_rank": -1},
    {"data_parallel_size": 2, "data_parallel_start_rank": 1, "data_parallel_size_local": 2},
    {"data_parallel_size": 2, "data_parallel_rpc_port": 0},
])
def test_bad_data_parallel_layouts_are_refused(kwargs):
    with pytest.raises(ValueError):
        create_engine_config(**kwargs)


def test_local_ranks():
    pc = create_engine_config(data_parallel_size=4).parallel_config
    assert list(pc.local_ranks) == [0, 1, 2, 3]
    pc = create_engine_config(data_parallel_size=4, data_parallel_start_rank=2).parallel_config
    assert (pc.data_parallel_size_local, list(pc.local_ranks)) == (2, [2, 3])
    pc = create_engine_config(data_parallel_size=4, data_parallel_size_local=1,
                              data_parallel_start_rank=1).parallel_config
    assert list(pc.local_ranks) == [1]


@pytest.mark.parametrize("argv, message", [
    # A start rank without --headless is hybrid load balancing (vLLM's rule), which needs the
    # local size.
    (["--data-parallel-size", "2", "--data-parallel-start-rank", "1"],
     "`--data-parallel-hybrid-lb` requires `--data-parallel-size-local`"),
    (["--data-parallel-size", "2", "--headless"], "--data-parallel-start-rank > 0"),
    (["--balance-scheduling"], "data_parallel_size >= 2"),
    (["--data-parallel-size", "2", "--data-parallel-start-rank", "2", "--headless"],
     "data_parallel_start_rank"),
])
def test_cli_refuses_bad_data_parallel_flags(argv, message):
    # A subprocess with a timeout: were a check missing, the command would start engines and wait.
    cmd = [sys.executable, "-m", "minicore", "serve", "--runner", "simulated",
           "--port", str(free_port()), "--data-parallel-rpc-port", str(free_port()), *argv]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 1
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and message in last_line, proc.stderr
