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
from minicore.engine.launch import STOP_TIMEOUT_S, CoreEngineProcManager, resolve_model

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig) -> None:
    """Run this machine's DP ranks until a signal, or until one of them exits."""
    pc = config.parallel_config
    if pc.data_parallel_backend == "ray":
        raise ValueError("--headless starts the ranks of another machine by hand (the mp "
                         "backend); with --data-parallel-backend ray, Ray starts them: join the "
                         "machine to the cluster with `ray start --address HEAD:6379` instead")
    if pc.data_parallel_start_rank == 0:
        raise ValueError("--headless runs the ranks of another machine than the frontend's: "
                         "give it --data-parallel-start-rank > 0")
    # The frontend's machine converts a GGUF for its engines; this one does for its own.
    config = resolve_model(config)
    handshake_address = f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port + 1}"
    logger.info("headless: starting DP ranks %s of %d, frontend at %s",
                list(pc.local_ranks), pc.data_parallel_size, handshake_address)
    manager = CoreEngineProcManager(config, handshake_address)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    exitcode = 0
    try:
        sentinels = {proc.sentinel: rank for rank, proc in manager.procs.items()}
        ready = multiprocessing.connection.wait(list(sentinels))
        rank = sentinels[ready[0]]
        proc = manager.procs[rank]
        # The sentinel is ready as the process exits, a moment before it can be reaped.
        proc.join(STOP_TIMEOUT_S)
        exitcode = 0 if proc.exitcode == 0 else 1
        logger.info("headless: DP rank %d exited with code %s; stopping the others.", rank,
                    proc.exitcode)
    finally:
        manager.close()
    sys.exit(exitcode)
