"""Headless DP ranks: engine processes on a machine without a frontend, for a frontend elsewhere.

Mirrors `vllm serve --headless` (run_headless in vllm/entrypoints/cli/serve.py with
CoreEngineProcManager from vllm/v1/engine/utils.py): start this machine's ranks (from
--data-parallel-start-rank, --data-parallel-size-local of them), which connect to the frontend's
handshake socket at --data-parallel-address, port --data-parallel-rpc-port + 1, and join the DP
group's rendezvous at --data-parallel-rpc-port; then wait. SIGTERM/SIGINT stop them; so does the
end of any one of them (its peers cannot go on without it), and each stops by itself when the
frontend goes away. Left out: Ray, elastic scaling, API servers without engines.
"""

import logging
import multiprocessing.connection
import signal
import sys

from minicore.config import EngineConfig
from minicore.engine.core_proc import start_engine_processes
from minicore.model.loader import resolve_model_dir

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


def run_headless(config: EngineConfig) -> None:
    """Run this machine's DP ranks until a signal, or until one of them exits."""
    pc = config.parallel_config
    if pc.data_parallel_start_rank == 0:
        raise ValueError("--headless runs the ranks of another machine than the frontend's: "
                         "give it --data-parallel-start-rank > 0")
    # The frontend's machine converts a GGUF for its engines; this one does for its own.
    config.model_config.model = str(resolve_model_dir(config.model_config.model))
    handshake_address = f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port + 1}"
    logger.info("headless: starting DP ranks %s of %d, frontend at %s",
                list(pc.local_ranks), pc.data_parallel_size, handshake_address)
    procs = start_engine_processes(config, handshake_address)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    exitcode = 0
    try:
        sentinels = {proc.sentinel: rank for rank, proc in procs.items()}
        ready = multiprocessing.connection.wait(list(sentinels))
        rank = sentinels[ready[0]]
        # The sentinel is ready as the process exits, a moment before it can be reaped.
        procs[rank].join(STOP_TIMEOUT_S)
        exitcode = 0 if procs[rank].exitcode == 0 else 1
        logger.info("headless: DP rank %d exited with code %s; stopping the others.", rank,
                    procs[rank].exitcode)
    finally:
        _stop(procs.values())
    sys.exit(exitcode)


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
