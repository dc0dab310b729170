"""`serve --api-server-count N`: N API server processes over one set of engines.

Mirrors run_multi_api_server (vllm/entrypoints/cli/serve.py) with APIServerProcessManager,
run_api_server_worker_proc and wait_for_completion_or_failure (vllm/v1/utils.py). This process,
the launcher, opens the HTTP port N times (SO_REUSEPORT: the kernel spreads the connections over
the servers), starts the engines and answers their handshake with every server's input and output
address, then spawns the servers (APIServer_0 .. N-1): each binds its pair (AsyncMPClient.attach)
and serves HTTP on its socket. An engine sends each request's outputs to the server that sent it,
and its stats and wave news to all (minicore/engine/client_router.py), so every server balances
over the engines on the same picture (vLLM publishes it from DPCoordinatorProc) and /metrics says
the same whichever server answers: gauges from the engines' stats, counters and histograms summed
over the servers by prometheus_client's multiprocess mode, in a directory of the launcher's (vLLM's
setup_multiprocess_prometheus). The periodic stats line is off, as vLLM's: each server sees only
its own requests.

Faults: an engine or an API server that exits stops the service: the launcher stops the rest and
exits 1, naming it (vLLM's rule for a server's non-zero exit; vLLM lets the others serve on after
one exits with 0, minicore does not: its DP ranks stop when their first server goes). SIGTERM or
SIGINT stops the servers first (each aborts what is in flight), then the engines; exit 0.
Left out: the Ray backend with several servers, elastic EP (vLLM caps it at one server).
"""

import asyncio
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time

import msgspec
import uvloop
import zmq.asyncio

from minicore.config import EngineConfig
from minicore.engine.launch import (
    STOP_TIMEOUT_S,
    CoreEngineProcManager,
    name_process,
    resolve_model,
    wait_for_engine_startup,
)
from minicore.entrypoints.metrics import MULTIPROCESS_DIR_ENV
from minicore.logger import configure_logging
from minicore.ports import free_port
from minicore.utils import bind_zmq_socket, listen_on, make_zmq_socket

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
# How often an API server checks that its launcher is alive.
LAUNCHER_CHECK_INTERVAL_S = 1.0


def run_multi_api_server(config: EngineConfig, args) -> None:
    """Serve with args.api_server_count API servers until SIGTERM/SIGINT (returns) or a process
    of the service exits (RuntimeError naming it)."""
    num_servers = args.api_server_count
    pc = config.parallel_config
    if pc.data_parallel_backend == "ray" or pc.engine_ranks != range(pc.data_parallel_size):
        raise ValueError("--api-server-count > 1 is supported with the mp backend's internal load "
                         "balancing only (not with ray, external or hybrid): run one API server")
    if not args.disable_log_stats:
        logger.warning("%d API servers: the periodic stats line is off (each server sees only "
                       "its own requests); /metrics has the whole", num_servers)
        args.disable_log_stats = True
    _raise_system_exit_on_signals()
    socks = [_listen(args) for _ in range(num_servers)]
    workdir = tempfile.mkdtemp(prefix="minicore-")  # mode 0700: the ipc sockets, the metrics
    os.environ[MULTIPROCESS_DIR_ENV] = os.path.join(workdir, "metrics")
    os.mkdir(os.environ[MULTIPROCESS_DIR_ENV])
    manager, servers = None, []
    try:
        config = resolve_model(config)
        addresses = frontend_addresses(config, num_servers, workdir)
        manager, num_blocks = uvloop.run(_start_engines(config, addresses, workdir))
        context = multiprocessing.get_context("spawn")  # a fresh prometheus_client, and no torch
        for index, sock in enumerate(socks):
            servers.append(context.Process(
                target=run_api_server_worker, name=f"APIServer_{index}",
                args=(config, args, sock, index, addresses, num_blocks, os.getpid())))
            servers[-1].start()
            sock.close()
        logger.info("%d API servers on http://%s:%d", num_servers, args.host, args.port)
        _wait_for_first_exit(servers, manager.procs)
    finally:
        _stop(servers, manager)
        shutil.rmtree(workdir, ignore_errors=True)


def _raise_system_exit_on_signals() -> None:
    """SIGTERM/SIGINT end the launcher's wait (or its startup) through its finally: vLLM's
    run_multi_api_server does the same."""
    def handler(signum, frame):
        signal.signal(signum, signal.SIG_IGN)  # once: the stop that follows is not interrupted
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _listen(args):
    """One server's listening socket on the port, which the others share (SO_REUSEPORT)."""
    try:
        sock = listen_on(args.host, args.port, "the API server", "--port", reuse_port=True)
    except RuntimeError as e:
        raise SystemExit(f"minicore: {e}") from None
    # A forked engine must not hold the port.
    os.register_at_fork(after_in_child=sock.close)
    return sock


def frontend_addresses(config: EngineConfig, num_servers: int,
                       workdir: str) -> dict[str, list[str]]:
    """Each API server's input and output address, the engines' handshake answer: ipc when every
    rank runs here, else tcp on the DP address (headless ranks on other machines connect)."""
    pc = config.parallel_config
    if len(pc.local_ranks) == pc.data_parallel_size:
        return {kind: [f"ipc://{workdir}/{kind}_{i}" for i in range(num_servers)]
                for kind in ("inputs", "outputs")}
    return {kind: [f"tcp://{pc.data_parallel_address}:{free_port()}" for _ in range(num_servers)]
            for kind in ("inputs", "outputs")}


async def _start_engines(config: EngineConfig, addresses: dict[str, list[str]],
                         workdir: str) -> tuple[CoreEngineProcManager, dict[int, int]]:
    """This machine's engines, started and READY (remote ranks too); each engine's KV blocks."""
    pc = config.parallel_config
    dp = pc.data_parallel_size > 1
    handshake_address = (f"tcp://{pc.data_parallel_address}:{pc.data_parallel_rpc_port + 1}"
                         if dp else f"ipc://{workdir}/handshake")
    manager = CoreEngineProcManager(config, handshake_address)
    loop = asyncio.get_running_loop()
    exited = loop.create_future()

    def on_exit(rank: int) -> None:
        proc = manager.procs[rank]
        loop.remove_reader(proc.sentinel)
        proc.join(1.0)
        if not exited.done():
            exited.set_result(f"engine core {rank}'s process exited with code {proc.exitcode}")

    for rank, proc in manager.procs.items():
        loop.add_reader(proc.sentinel, functools.partial(on_exit, rank))
    ctx = zmq.asyncio.Context()
    try:
        handshake = (bind_zmq_socket(ctx, zmq.ROUTER, pc.data_parallel_address,
                                     pc.data_parallel_rpc_port + 1, "the engines' handshake",
                                     "--data-parallel-rpc-port", value=pc.data_parallel_rpc_port)
                     if dp else make_zmq_socket(ctx, handshake_address, zmq.ROUTER, bind=True))
        num_blocks = await wait_for_engine_startup(
            handshake, msgspec.msgpack.encode(addresses), pc.engine_ranks, manager.procs,
            time.monotonic() + STARTUP_TIMEOUT_S, exited)
    except BaseException:
        manager.close()
        raise
    finally:
        for proc in manager.procs.values():
            loop.remove_reader(proc.sentinel)
        ctx.destroy(linger=0)
    logger.info("%d engine core(s) ready: KV blocks by engine %s", pc.data_parallel_size,
                num_blocks)
    return manager, num_blocks


def _wait_for_first_exit(servers: list, engines: dict) -> None:
    """Block until an API server or an engine exits; then raise, naming it."""
    watched = {proc.sentinel: proc for proc in [*servers, *engines.values()]}
    proc = watched[multiprocessing.connection.wait(list(watched))[0]]
    proc.join(1.0)
    raise RuntimeError(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}: "
                       "the service stops")


def _stop(servers: list, manager: CoreEngineProcManager | None) -> None:
    """The API servers first (SIGTERM: each aborts its requests and exits), then the engines;
    SIGKILL to what has not stopped within STOP_TIMEOUT_S."""
    for proc in servers:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in servers:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("%s did not stop within %g s: killing it", proc.name, STOP_TIMEOUT_S)
            proc.kill()
            proc.join()
    if manager is not None:
        manager.close()


# ---- in an API server process -------------------------------------------------------------------

def run_api_server_worker(config: EngineConfig, args, sock, index: int,
                          addresses: dict[str, list[str]], num_blocks: dict[int, int],
                          launcher_pid: int) -> None:
    """Entry point of API server `index`: attach to the engines, serve HTTP on sock until
    SIGTERM/SIGINT (exit 0), or until the launcher is gone."""
    from minicore.entrypoints.tool_parsers import ToolParserManager
    from minicore.entrypoints.utils import exit_zero_after_shutdown_signals

    name = f"APIServer_{index}"
    name_process(name)
    configure_logging(name)
    exit_zero_after_shutdown_signals()
    if args.tool_parser_plugin:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    uvloop.run(_serve_worker(config, args, sock, index, addresses, num_blocks, launcher_pid))


async def _serve_worker(config: EngineConfig, args, sock, index: int,
                        addresses: dict[str, list[str]], num_blocks: dict[int, int],
                        launcher_pid: int) -> None:
    from minicore.dp.client import engine_client_class
    from minicore.engine.async_llm import DEFAULT_MODEL_NAME, AsyncLLM
    from minicore.entrypoints.api_server import serve_http
    from minicore.model.loader import load_tokenizer
    from minicore.utils import freeze_gc_heap

    mc = config.model_config
    tokenizer, vocab_size = await asyncio.to_thread(load_tokenizer, mc.model, mc.tokenizer)
    client = engine_client_class(config)(config)
    try:
        client.attach(addresses["inputs"][index], addresses["outputs"][index], num_blocks,
                      STARTUP_TIMEOUT_S)
    except BaseException:
        await client.shutdown()
        raise
    freeze_gc_heap()
    llm = AsyncLLM(config, tokenizer, vocab_size, mc.model_source or DEFAULT_MODEL_NAME, client)
    _watch_launcher(launcher_pid)
    with sock:
        await serve_http(config, args, sock, llm)


def _watch_launcher(launcher_pid: int) -> None:
    """A launcher killed without stopping its servers leaves them orphaned (its engines stop
    themselves): stop as on SIGTERM."""
    loop = asyncio.get_running_loop()

    def check() -> None:
        if os.getppid() != launcher_pid:
            logger.warning("the launcher process is gone; shutting down.")
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            loop.call_later(LAUNCHER_CHECK_INTERVAL_S, check)

    loop.call_later(LAUNCHER_CHECK_INTERVAL_S, check)
