"""The engine's control plane: what a frontend calls on an engine by name, as RL and colocation
users drive vLLM (sleep and wake up, pause and resume, collective_rpc, the weight update).

Mirrors the utility methods of EngineCore in vllm/v1/engine/core.py (sleep, pause, the weight
update and their kin, under vLLM's names) and EngineCoreProc's UTILITY handling (the result or
the error goes back as a UtilityOutput; a method may finish later, when the engine is idle;
vLLM's _convert_msgspec_args has nothing to convert: no method takes a Struct). EngineControl
is mixed into EngineCore; ProcControl into EngineCoreProc, where "idle" is the busy loop's (a DP
rank's: its wave ended on every rank).
The guarded surface: a UTILITY message may name only the public methods of EngineControl
(UTILITY_METHODS), and collective_rpc only what minicore/engine/worker_rpc.py lets through.
Left out: LoRA, profiling, IPC weight transfer (the runner's group is NCCL's or
gloo's: minicore/dp/weight_transfer.py).
"""

import asyncio
import inspect
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import msgspec

from minicore.engine.worker_rpc import resolve_worker_call
from minicore.protocol import EngineCoreOutput, FinishReason, UtilityOutput

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
# What sleep releases and wake_up(tags) brings back (vLLM's CuMemAllocator tags), and the tag of
# a level-0 sleep, which only pauses scheduling (vLLM 0.32).
SLEEP_TAGS = ("weights", "kv_cache")
WAKE_TAGS = (*SLEEP_TAGS, "scheduling")


def check_pause_mode(mode) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")


def check_sleep_level(level) -> None:
    if level not in (0, 1, 2):
        raise ValueError(f"sleep level must be 0, 1 or 2, not {level!r}")


def wake_tags(tags: list[str] | None) -> list[str]:
    """wake_up's tags (None: all), ValueError for one that is not a tag."""
    tags = list(WAKE_TAGS) if tags is None else tags
    if unknown := sorted(set(tags) - set(WAKE_TAGS)):
        raise ValueError(f"unknown wake_up tag(s) {unknown}; the tags are {list(WAKE_TAGS)}")
    return tags


class EngineControl:
    """The utility methods. State defaults are class attributes: nothing to set up."""

    sleep_level = 0
    sleeping_tags: frozenset[str] = frozenset()
    # The sleep still pausing (mode "wait" waits for the requests in flight): a wake_up
    # meanwhile calls it off, so that the later call wins, as its caller expects.
    _pending_sleep: object = None
    weight_version = "default"
    weight_update_open = False

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    # ---- pause ---------------------------------------------------------------------------------

    def pause_scheduler(self, mode: PauseMode = "abort", clear_cache: bool = True):
        """Stop scheduling (vLLM 0.32's modes): "abort" aborts every request first, "keep" freezes
        them where they are (clear_cache then preempts the running ones: recomputed on resume,
        with whatever weights the engine has by then), "wait" lets them finish first. Completes
        when the engine is idle."""
        check_pause_mode(mode)
        if mode == "abort":
            ids = [rid for rid, r in self.scheduler.requests.items() if not r.is_finished()]
            self.abort_requests(ids)
            self._announce_aborted(ids)
        if mode != "wait":
            _shut(self.scheduler)
        return self._after_idle(partial(self._finish_pause, clear_cache))

    def _finish_pause(self, clear_cache: bool) -> None:
        _shut(self.scheduler)
        if clear_cache and not self.reset_prefix_cache(reset_running_requests=True):
            logger.warning("pause: the prefix cache was not reset (a KV connector holds blocks)")

    def resume_scheduler(self) -> None:
        """Schedule again; a level-0 sleep ends with it."""
        if released := self.sleeping_tags & set(SLEEP_TAGS):  # a step would lack its memory
            raise ValueError(f"the engine is asleep ({', '.join(sorted(released))} released): "
                             "wake_up resumes it")
        self.sleeping_tags = frozenset()
        _open(self.scheduler)

    def is_scheduler_paused(self) -> bool:
        return "has_requests" in vars(self.scheduler)  # shut by _shut

    # ---- sleep ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: PauseMode = "abort"):
        """Pause (mode), then release memory: the KV cache at level 1 and 2, the weights at
        level 2 (on CUDA level 1 moves them to pinned CPU memory); level 0 only pauses (vLLM
        0.32: the "scheduling" tag). The scheduler stays paused until every tag is awake again."""
        check_sleep_level(level)
        if level and self.config.kv_transfer_config is not None:
            raise ValueError("sleep mode with a KV connector is not supported: the connector "
                             "registered the KV cache's memory with its peers")
        if self.sleeping_tags and level == self.sleep_level:
            return None  # asleep as asked already (vLLM's sleep is idempotent too)
        if self.sleeping_tags:
            raise ValueError(f"the engine is already asleep (level {self.sleep_level}): wake it "
                             "up first")
        if level:
            self.model_runner.check_can_sleep(level)
        call = self._pending_sleep = object()
        pause = self.pause_scheduler(mode, clear_cache=level > 0)
        return self._then(pause, partial(self._release, level, call))

    def _release(self, level: int, call: object):
        if call is not self._pending_sleep:  # a wake_up came while this sleep paused
            self.resume_scheduler()
            return None
        self._pending_sleep = None
        if not level:
            self.sleeping_tags = frozenset({"scheduling"})
            return None
        # Asleep from now (resume is refused), while the runner frees its memory on its thread.
        self.sleep_level, self.sleeping_tags = level, frozenset(SLEEP_TAGS)
        release = partial(self.model_runner.sleep, level)
        return self._then(self._on_forward_thread(release, None), lambda: None)

    def release_kv_cache_memory(self):
        """Free the KV cache's memory (vLLM 0.32), once a pause has completed with no request
        kept: wake_up(["kv_cache"]) brings it back and resumes scheduling."""
        if not self.is_scheduler_paused() or self.scheduler.requests:
            raise ValueError("release_kv_cache_memory needs a completed pause with no request "
                             "kept first (POST /pause or /sleep?level=0, mode abort or wait)")
        if self.sleeping_tags & set(SLEEP_TAGS):
            raise ValueError("release_kv_cache_memory needs the engine's memory resident: it "
                             "is asleep")
        self.reset_prefix_cache()
        self.sleeping_tags |= {"kv_cache"}
        return self._on_forward_thread(partial(self.model_runner.sleep, 0), None)

    def wake_up(self, tags: list[str] | None = None):
        """Bring back what tags name ("weights", "kv_cache", "scheduling": a level-0 sleep; None:
        all); once the memory is all back, scheduling resumes (vLLM's rule), a pause's too. A
        sleep still pausing is called off."""
        waking = sorted(self.sleeping_tags & set(wake_tags(tags)))
        self._pending_sleep = None
        # On the runner's thread: reloading a model's weights may take a while.
        restore = partial(self.model_runner.wake_up, [t for t in waking if t in SLEEP_TAGS],
                          self.sleep_level)
        return self._then(self._on_forward_thread(restore, None), partial(self._woken, waking))

    def _woken(self, tags: list[str]) -> None:
        self.sleeping_tags -= set(tags)
        if not self.sleeping_tags & set(SLEEP_TAGS):
            self.sleep_level, self.sleeping_tags = 0, frozenset()
            self.resume_scheduler()

    def is_sleeping(self) -> bool:
        """Asleep at any level, or paused (vLLM 0.32 counts a paused scheduler)."""
        return bool(self.sleeping_tags) or self.is_scheduler_paused()

    def get_sleep_level(self) -> int:
        """0 awake, else the level it sleeps at (the engine_sleep_state gauge)."""
        return self.sleep_level

    # ---- workers and weights -------------------------------------------------------------------

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None):
        """Run method on every worker (here one: the runner, on its forward thread, between
        steps): a name of the runner's public methods, or a callable given the runner first.
        A list of one result per worker."""
        call = partial(resolve_worker_call(self.model_runner, method), *args, **(kwargs or {}))
        return self._on_forward_thread(call, timeout)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.weight_update_open = True

    def update_weights(self, update_info: dict):
        """The runner loads weights in place (from a file, or as the trainer broadcasts them),
        between start_weight_update and finish_weight_update."""
        if not self.weight_update_open:
            raise ValueError("no weight update in progress: call start_weight_update first")
        return self._on_forward_thread(
            partial(self.model_runner.update_weights, update_info), None)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.weight_update_open = False
        if weight_version is not None:
            self.weight_version = str(weight_version)

    def get_weight_version(self) -> str:
        return self.weight_version

    def update_weight_version(self, weight_version: str) -> None:
        self.weight_version = str(weight_version)

    def reinitialize_distributed(self, new_data_parallel_size: int, port: int):
        """Elastic EP, on a paused DP rank: re-form the DP group with new_data_parallel_size
        ranks at port, re-shard the experts (minicore/dp/elastic_ep.py; refused without it)."""
        return self.elastic_ep.reinitialize(self, new_data_parallel_size, port)

    # ---- for operators and tests ---------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """The scheduler's stats, plus what the frontend cannot see: unfinished request ids."""
        stats = self.scheduler.make_stats()
        return {**{name: getattr(stats, name) for name in stats.__struct_fields__},
                "num_blocks": self.config.cache_config.num_blocks,
                "request_ids": sorted(self.scheduler.requests)}

    def ping(self) -> str:
        return "pong"

    # ---- in-process: the engine is idle between calls ------------------------------------------

    def _after_idle(self, fn: Callable[[], Any]):
        if self.scheduler.has_requests():
            raise ValueError("the engine has requests in flight, and an in-process engine cannot "
                             "wait for them: pause with mode 'abort' or 'keep'")
        return fn()

    def _then(self, first, fn: Callable[[], Any]):
        return fn()

    def _on_forward_thread(self, call: Callable[[], Any], timeout: float | None) -> list:
        return [self.executor.submit(call).result(timeout)]

    def _announce_aborted(self, request_ids: list[str]) -> None:
        """Whoever drives an in-process engine aborted its own requests."""


class ProcControl(EngineControl):
    """In an engine process, what waits for idle returns a coroutine, awaited off the busy loop;
    the busy loop calls _notify_idle whenever it waits for input with nothing to do."""

    # Replaced, never appended to in place: this class-level empty list is only the default.
    _idle_waiters: list[asyncio.Future] = []

    def _after_idle(self, fn: Callable[[], Any]):
        future = asyncio.get_running_loop().create_future()
        self._idle_waiters = [*self._idle_waiters, future]

        async def run():
            await future
            return fn()
        return run()

    def _then(self, first, fn: Callable[[], Any]):
        async def run():
            await first
            result = fn()
            return await result if inspect.isawaitable(result) else result
        return run()

    def _notify_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    async def _on_forward_thread(self, call: Callable[[], Any], timeout: float | None) -> list:
        future = asyncio.get_running_loop().run_in_executor(self.executor, call)
        return [await asyncio.wait_for(future, timeout)]

    def _announce_aborted(self, request_ids: list[str]) -> None:
        self._send([EngineCoreOutput(rid, [], FinishReason.ABORT) for rid in request_ids])

    def _call_utility(self, call_id: int, method: str, args: list) -> None:
        """Run a UTILITY call; the reply is sent now or, for one that completes later, then."""
        try:
            result = call_utility(self, method, args)
        except Exception as e:
            return self._reply_utility(call_id, method, error=e)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            task.add_done_callback(partial(self._utility_done, call_id, method))
        else:
            self._reply_utility(call_id, method, result)

    def _utility_done(self, call_id: int, method: str, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        self._reply_utility(call_id, method, None if error else task.result(), error)

    def _reply_utility(self, call_id: int, method: str, result: Any = None,
                       error: BaseException | None = None) -> None:
        output = UtilityOutput(call_id)
        if error is None:
            try:
                output.result = msgspec.to_builtins(result)
            except (TypeError, msgspec.MsgspecError) as e:
                error = TypeError(f"its result cannot be sent back ({e})")
        if error is not None:
            logger.error("EngineCore %d: utility %s failed: %r", self.engine_index, method, error)
            output.failure_message = f"call to {method} failed: {error}"
            output.caller_error = isinstance(error, ValueError)
        self._send(utility_output=output)


def _no_work() -> bool:
    return False


def _shut(scheduler) -> None:
    """The pause (vLLM's PauseState.PAUSED_ALL) as a gate: the scheduler reports no work, so the
    engine stops stepping and a DP rank counts as idle. Bound over the two questions the engine
    asks (Scheduler.has_requests, has_unfinished_requests), not a flag the scheduler tests every
    step; the requests stay where they are."""
    scheduler.has_requests = scheduler.has_unfinished_requests = _no_work


def _open(scheduler) -> None:
    vars(scheduler).pop("has_requests", None)
    vars(scheduler).pop("has_unfinished_requests", None)


# The methods a UTILITY message may name: EngineControl's public ones.
UTILITY_METHODS = frozenset(name for name, value in vars(EngineControl).items()
                            if callable(value) and not name.startswith("_"))


def call_utility(engine: EngineControl, method: str, args: list | tuple):
    """engine.method(*args); ValueError, before anything runs, for a name outside
    UTILITY_METHODS or arguments the method does not take."""
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown utility method {method!r}; the engine's utility methods are "
                         f"{', '.join(sorted(UTILITY_METHODS))}")
    bound = getattr(engine, method)
    try:
        inspect.signature(bound).bind(*args)
    except TypeError as e:
        raise ValueError(f"{method}: {e}") from None
    return bound(*args)
