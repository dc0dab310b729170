"""SIGTERM stops an engine process that is blocked in C++ during startup: DP rank 1 waiting in
torch's rendezvous for a rank 0 that never listens (its port was in use, say) ignores Python's
signal handler until torch gives up (HANDSHAKE_TIMEOUT_S, minutes), so before the startup signal
watch of minicore/engine/launch.py its launcher waited STOP_TIMEOUT_S and then killed it."""

import os
import signal
import time

from engine_helpers import FakeFrontend, simulated_config

from minicore.engine.launch import STARTUP_SIGNAL_GRACE_S, run_engine_core
from minicore.ports import free_port_pair

EXIT_WITHIN_S = STARTUP_SIGNAL_GRACE_S + 3.0


def test_sigterm_stops_a_rank_blocked_in_the_rendezvous():
    config = simulated_config(data_parallel_size=2, data_parallel_rpc_port=free_port_pair())
    with FakeFrontend() as frontend:
        proc = frontend.start(run_engine_core, config, engine_index=1)
        identity, hello = frontend.hello()
        assert hello == {"status": "HELLO", "engine_index": 1}
        frontend.handshake.send_multipart([identity, frontend.encoder.encode(
            {"inputs": [frontend._address("input")], "outputs": [frontend._address("output")]})])
        # Its first input frame comes just before it joins the DP group, where it blocks.
        assert frontend.recv(frontend.input, 30) == [identity, b""]
        time.sleep(1.0)
        assert proc.is_alive()
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
        assert proc.exitcode == 0
        assert time.monotonic() - start < EXIT_WITHIN_S
