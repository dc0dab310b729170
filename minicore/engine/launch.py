"""Start this machine's engine processes, bring them up, and watch them.

Mirrors vllm/v1/engine/utils.py (CoreEngineProcManager, launch_core_engines,
wait_for_engine_startup) and EngineCoreProc.run_engine_core (vllm/v1/engine/core.py), the entry
point of every engine process. The frontend (minicore/engine/core_client.py) and headless DP ranks
(minicore/dp/launch.py) both start their engines here.

Startup handshake (the frontend binds, every engine connects, in any order):
  engine -> frontend  HELLO {"status": "HELLO", "engine_index": i}          (handshake socket)
  frontend -> engine  {"inputs": [address], "outputs": [address]} (one each per API server)
  engine connects its DEALER input (identity = i as 2 bytes) and PUSH output, sends an empty frame
  on the input so the frontend's ROUTER learns its identity, builds its EngineCore (loads the
  model), then: engine -> frontend  READY {"status": "READY", "num_gpu_blocks": KV blocks}
  or, if that failed, FAILED {"status": "FAILED", "error": why}: for a rank on another machine the
  frontend stops at once, naming it and the cause (a local engine's exit already tells it)
An engine that cannot start logs why (one line for a bad configuration or a port in use) and exits
1; one still starting stops on SIGTERM/SIGINT within a second even when blocked in C++, as a DP
rank waiting in torch's rendezvous is. Several API servers: entrypoints/multi_api_server.py.
Left out: Ray (minicore/dp/ray_launch.py), elastic scaling.
"""

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import msgspec
import uvloop
import zmq.asyncio

from minicore.arg_utils import derived_max_model_len, read_json_file
from minicore.config import EngineConfig
from minicore.engine.components import build_components
from minicore.engine.core_proc import HANDSHAKE_TIMEOUT_S, EngineCoreProc
from minicore.logger import configure_logging, init_logger
from minicore.model.registry import runner_info
from minicore.utils import ListenError

logger = init_logger(__name__)

STOP_TIMEOUT_S = 5.0
# How long an engine still starting may take to act on SIGTERM/SIGINT before it is made to exit.
STARTUP_SIGNAL_GRACE_S = 1.0
# How long a frontend told that a remote rank failed waits for its own engines' exits.
REMOTE_FAILURE_GRACE_S = 3.0
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
SHUTDOWN_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def resolve_model(config: EngineConfig) -> EngineConfig:
    """The config with its model resolved to a safetensors directory (a GGUF is converted once and
    cached), so that the frontend and every engine read the same files, and max_model_len auto
    (-1) to the model's context length. With expert parallelism, a model it cannot serve is
    refused here, from its config alone, before any engine starts (ExpertParallelError, a
    ValueError: `serve` prints it as a configuration error)."""
    from minicore.model.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(config.model_config.model))
    pc = config.parallel_config
    if pc.enable_expert_parallel:
        from transformers import AutoConfig

        from minicore.model.expert_parallel import check_expert_parallel
        from minicore.model.loader import check_config_attention

        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        # An attention minicore cannot run would pass the MoE check: refused here too, before
        # any engine starts.
        check_config_attention(hf_config)
        check_expert_parallel(hf_config, pc.data_parallel_size)
    config = resolve_max_model_len(config, read_json_file(model_dir, "config.json"),
                                   read_json_file(config.model_config.tokenizer or model_dir,
                                                  "tokenizer_config.json"))
    return dataclasses.replace(config, model_config=dataclasses.replace(
        config.model_config, model=model_dir, model_source=config.model_config.model))


def resolve_max_model_len(config: EngineConfig, hf_config: dict,
                          tokenizer_config: dict) -> EngineConfig:
    """--max-model-len auto (-1): the model's context length (vLLM's derivation, from its
    config.json and tokenizer_config.json as dicts); any other value as it is."""
    sc = config.scheduler_config
    if sc.max_model_len != -1:
        return config
    max_model_len = derived_max_model_len(hf_config, tokenizer_config)
    logger.info("max_model_len auto: %d, the model's context length", max_model_len)
    return dataclasses.replace(config, scheduler_config=dataclasses.replace(
        sc, max_model_len=max_model_len))


# ---- in the engine process ----------------------------------------------------------------------

def run_engine_core(config: EngineConfig, handshake_address: str, engine_index: int = 0, *,
                    handshake_timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Entry point of an engine process (forked or spawned: engine_start_method): handshake, load
    the model, serve until SIGTERM/SIGINT (exit 0) or a fatal error (ENGINE_CORE_DEAD, exit 1)."""
    # A forked engine inherits the frontend's running event loop as its own: forget it, or
    # uvloop.run below refuses to start.
    asyncio._set_running_loop(None)
    name_process(f"EngineCore_DP{engine_index}")
    configure_engine_process(config, engine_index)
    shutdown_requested = False

    def signal_handler(signum, frame):
        # Until the event loop takes over the signals (startup: handshake, model load).
        nonlocal shutdown_requested
        if not shutdown_requested:
            shutdown_requested = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, signal_handler)
    signal.signal(signal.SIGINT, signal_handler)
    stop_watch = _watch_signals_during_startup()
    # A forked engine's were blocked until now (_shutdown_signals_blocked).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHUTDOWN_SIGNALS)
    engine_core: EngineCoreProc | None = None
    fatal = False
    try:
        engine_core_cls = EngineCoreProc
        if config.parallel_config.data_parallel_size > 1:
            # Imported here: a single engine needs neither the DP group nor torch.distributed.
            from minicore.dp.engine import DPEngineCoreProc

            engine_core_cls = DPEngineCoreProc
        try:
            engine_core = engine_core_cls(config, build_components, handshake_address,
                                          engine_index, handshake_timeout)
        finally:
            stop_watch()
        log_engine_config(engine_core.config, engine_core.model_runner)
        uvloop.run(engine_core.run())
        logger.info("EngineCore exiting.")
    except SystemExit:
        logger.info("EngineCore exiting.")
        raise
    except Exception as e:
        # Exiting already: a SIGTERM from the frontend now must not raise into the teardown.
        fatal = shutdown_requested = True
        if engine_core is None and isinstance(e, (ValueError, ListenError)):
            # A configuration the engine cannot run (KV cache too small, unsupported model, a
            # port in use): the message says it all; the traceback only at debug level.
            logger.error("EngineCore failed to start: %s", e,
                         exc_info=logger.isEnabledFor(logging.DEBUG))
        elif engine_core is None:
            logger.exception("EngineCore failed to start.")
        # A fatal error after startup was logged, and ENGINE_CORE_DEAD sent, by run().
        sys.exit(1)
    finally:
        if engine_core is not None:
            engine_core.close(fatal)


def _watch_signals_during_startup():
    """Make SIGTERM/SIGINT stop an engine that is still starting, within STARTUP_SIGNAL_GRACE_S;
    returns the function that ends the watch, once startup is over. Python runs a signal handler
    only between the main thread's bytecodes: a DP rank blocked in torch's rendezvous (its rank 0
    failed to start) would otherwise ignore the signal for minutes, and its launcher would wait
    for it. The C-level handler writes each signal to the wakeup fd at once: a thread reading it
    exits the process, with the handler's status 0, if the handler has not done so by then."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    over = threading.Event()

    def watch():
        signalled = os.read(read_fd, 1)  # b"" once stop() closed the pipe
        os.close(read_fd)
        if signalled and not over.wait(STARTUP_SIGNAL_GRACE_S):
            logger.info("EngineCore exiting (a signal, while blocked in startup).")
            os._exit(0)

    def stop():
        over.set()
        signal.set_wakeup_fd(-1)
        os.close(write_fd)

    threading.Thread(target=watch, daemon=True, name="startup_signal_watch").start()
    return stop


def log_engine_config(config: EngineConfig, runner) -> None:
    """One INFO line with the effective config, values resolved (vLLM's "Initializing a V1 LLM
    engine ... with config: ..."): logged by each engine once its model and KV cache are up."""
    mc, sc, cc = config.model_config, config.scheduler_config, config.cache_config
    model = getattr(runner, "model", None)  # the simulated runner has no model
    kv_caches = getattr(runner, "kv_caches", None) or []
    kv_bytes = sum(t.numel() * t.element_size() for t in kv_caches)
    logger.info(
        "Initializing a minicore engine with config: model=%r, tokenizer=%r, runner=%s, "
        "dtype=%s, device=%s, max_seq_len=%d, block_size=%d, kv_cache=%d blocks (%d tokens, "
        "%.2f GiB), max_num_seqs=%d, max_num_batched_tokens=%d, enable_prefix_caching=%s, "
        "enable_chunked_prefill=%s, scheduling_policy=%s, data_parallel_size=%d, seed=%d, "
        "generation_config=%s, speculative_config=%s, async_scheduling=%s, batch_invariant=%s",
        mc.model,
        mc.tokenizer or mc.model, mc.runner, getattr(model, "dtype", "none"),
        getattr(runner, "device", "none"),
        sc.max_model_len, cc.block_size, cc.num_blocks, (cc.num_blocks - 1) * cc.block_size,
        kv_bytes / 2**30, sc.max_num_seqs, sc.max_num_batched_tokens, cc.enable_prefix_caching,
        sc.enable_chunked_prefill, sc.policy, config.parallel_config.data_parallel_size,
        mc.seed, mc.generation_config, config.speculative_config, sc.async_scheduling,
        mc.batch_invariant)


def configure_engine_process(config: EngineConfig, engine_index: int) -> None:
    """Logging and torch threads of an engine process (spawned here, or a Ray actor's)."""
    configure_logging(f"EngineCore_DP{engine_index}")  # vLLM's name for an engine process
    if not runner_info(config.model_config.runner).needs_weights:
        return  # no torch to configure
    import torch

    device = config.model_config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu":
        # The local DP ranks share every core: the frontend mostly waits on sockets (one thread
        # fewer, to leave it a core, served less: docs/BENCHMARKS.md).
        num_local = config.parallel_config.data_parallel_size_local or 1
        threads = (os.environ.get("MINICORE_CPU_THREADS")
                   or max(1, (os.cpu_count() or 1) // num_local))
        torch.set_num_threads(int(threads))


def name_process(name: str) -> None:
    """The name `ps`, `top` and psutil show for this process (Linux: its comm, 15 characters), as
    vLLM titles its engine processes: a forked engine's command line is its frontend's."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])


# ---- in the process that starts them (the frontend, or a headless launcher) -------------------

def engine_start_method(config: EngineConfig) -> str:
    """How this process starts its engine processes: VLLM_WORKER_MULTIPROC_METHOD (vLLM's
    variable: fork or spawn; unset, spawn), fork turned into spawn where the engines will run on
    CUDA, as vLLM's _maybe_force_spawn (a forked child cannot use a CUDA its parent has touched).
    fork suits only a process that has run no torch computation: OpenMP's thread pool, once
    started, hangs a forked child's first parallel region. `serve` asks for it (its frontend only
    loads a tokenizer): each engine then starts with the frontend's imports, about 7 s of CPU
    less (docs/BENCHMARKS.md). An application embedding AsyncLLM keeps spawn unless it sets it."""
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in ("fork", "spawn"):
        raise ValueError(f"{START_METHOD_ENV} must be fork or spawn, got {method!r}")
    mc = config.model_config
    if (method == "fork" and runner_info(mc.runner).needs_weights
            and not (mc.device or "").startswith("cpu")):
        import torch

        if torch.cuda.is_available():
            logger.info("engines start by spawn, not fork: they run on CUDA")
            return "spawn"
    return method


async def wait_for_engine_startup(handshake: zmq.asyncio.Socket, addresses: bytes,
                                  ranks: range, local_ranks, deadline: float,
                                  engine_exited: asyncio.Future) -> dict[int, int]:
    """HELLO, then READY, from the engines of these DP ranks, in any order: answer each HELLO with
    the addresses to connect to. Returns each rank's number of KV blocks. engine_exited resolves,
    with the reason, when a local engine process exits: then startup fails at once instead of at
    the deadline."""
    engines = set(ranks)
    waiting_hello, num_blocks = set(engines), {}
    while len(num_blocks) < len(engines):
        what = (f"HELLO from engine(s) {sorted(waiting_hello)}" if waiting_hello
                else f"READY from engine(s) {sorted(engines - set(num_blocks))}")
        recv = asyncio.ensure_future(handshake.recv_multipart())
        done, _ = await asyncio.wait({recv, engine_exited},
                                     timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if recv not in done:
            recv.cancel()
            raise _startup_error(what, engine_exited, sorted(engines - set(local_ranks)))
        identity, frame = recv.result()
        message, index = msgspec.msgpack.decode(frame), int.from_bytes(identity, "little")
        status = message.get("status") if isinstance(message, dict) else None
        if status == "HELLO" and index in waiting_hello:
            waiting_hello.remove(index)
            await handshake.send_multipart([identity, addresses])
        elif status == "READY" and index in engines and index not in waiting_hello:
            num_blocks[index] = message["num_gpu_blocks"]
        elif status == "FAILED" and index in engines:
            # A local engine's exit says it (engine_exited), after its own log line; a rank on
            # another machine (headless) has only this to tell its frontend.
            if index not in local_ranks:
                # Ranks that disagree fail together: a local engine's exit, if it comes, is told
                # instead (its log line already names the cause).
                await asyncio.wait({engine_exited}, timeout=REMOTE_FAILURE_GRACE_S)
                if engine_exited.done():
                    raise _startup_error(what, engine_exited, [])
                raise RuntimeError(f"engine core {index} failed to start: {message.get('error')}")
        else:
            raise RuntimeError(f"engine handshake: unexpected {message!r} from engine {index} "
                               f"(a DP rank started twice, or not one of ranks {list(ranks)}?)")
    return num_blocks


def _startup_error(what: str, engine_exited: asyncio.Future, remote: list[int]) -> Exception:
    if engine_exited.done():
        return RuntimeError(f"{engine_exited.result()} during startup, while waiting for {what}; "
                            "see its log above")
    hint = f" (ranks {remote} are not started here: start them with --headless)" if remote else ""
    return TimeoutError(f"no {what} within the startup timeout{hint}")


class CoreEngineProcManager:
    """This machine's engine processes, one per local DP rank, by rank. They are daemons: they
    do not outlive the process that started them."""

    def __init__(self, config: EngineConfig, handshake_address: str):
        self.procs: dict[int, multiprocessing.Process] = {}
        method = engine_start_method(config)
        context = multiprocessing.get_context(method)
        hold_signals = _shutdown_signals_blocked if method == "fork" else contextlib.nullcontext
        for local_rank, rank in enumerate(config.parallel_config.local_ranks):
            proc = context.Process(target=run_engine_core, name=f"EngineCore_DP{rank}",
                                   daemon=True, args=(config, handshake_address, rank))
            with _visible_device(config, local_rank), hold_signals():
                proc.start()
            self.procs[rank] = proc

    def terminate(self) -> None:
        """SIGTERM to every process still alive; does not wait."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL to what has not stopped within timeout; blocks until all are
        reaped."""
        self.terminate()
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("engine core %d did not stop within %g s: killing it", rank, timeout)
                proc.kill()
                proc.join(timeout)


@contextlib.contextmanager
def _shutdown_signals_blocked():
    """SIGTERM and SIGINT held back from a forked engine until its own handlers are in place
    (run_engine_core unblocks them): until then it has its frontend's, which pass a signal on to
    the frontend's event loop and nothing else, and a signal sent as it starts (the frontend
    failing at once) would be lost. They wait, pending, in the frontend for as long."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def _visible_device(config: EngineConfig, local_rank: int):
    """On CUDA with several local DP ranks, the process started here sees only its own GPU (as
    vLLM sets CUDA_VISIBLE_DEVICES per engine process)."""
    mc = config.model_config
    if (config.parallel_config.data_parallel_size_local < 2
            or not runner_info(mc.runner).needs_weights or (mc.device or "cuda").startswith("cpu")):
        yield
        return
    import torch

    if not torch.cuda.is_available():
        yield
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if local_rank >= len(devices):
        raise ValueError(f"{config.parallel_config.data_parallel_size_local} local DP ranks need "
                         f"as many GPUs; this machine has {len(devices)}")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank]
    try:
        yield
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
