"""vLLM's development and RL endpoints, mounted only with VLLM_SERVER_DEV_MODE=1: sleep and wake
up, pause and resume, collective_rpc, and the weight update from a local file.

Mirrors vllm/entrypoints/serve/dev/ and vllm/entrypoints/serve/rlhf/api_router.py: each route
calls AsyncLLM's control plane (minicore/engine/async_llm.py), which calls every engine's utility
method (minicore/engine/control.py). Whoever reaches the port can stop generation, free the
engines' memory and make every engine load any local safetensors file its user may read: mount
these only where the port is the operator's; with --api-key, every route here needs the key. The
answers are vLLM 0.32's: /sleep {"status": "sleeping", "level": N} (level 0 only pauses), /wake_up
{"status": "awake", "tags": [...]} ("scheduling" among the tags), /is_sleeping true while paused,
/release_kv_cache_memory after a pause. Bad arguments are a 400 with an OpenAI error body, a
failure in an engine a 500; /start_draft_weight_update is a 400 with vLLM's message (minicore's
drafts have no weights). The weight transfer engine is an NCCL or gloo group with the trainer
(minicore/dp/weight_transfer.py). Left out: IPC transfers, the system survey in /server_info's
system_env (vLLM's collect_env).
"""

import dataclasses
import json
import os
import platform
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, FastAPI, Query

import minicore
from minicore.engine.async_llm import AsyncLLM
from minicore.engine.control import PauseMode
from minicore.entrypoints.metrics import OperationMetrics, ServerMetrics
from minicore.entrypoints.openai_errors import OpenAIError
from minicore.entrypoints.utils import json_response

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV) == "1"


async def _control(call) -> Any:
    """Await a control-plane call: ValueError (bad arguments) is a 400, an engine's failure
    (RuntimeError) a 500, both with the message."""
    try:
        return await call
    except ValueError as e:
        raise OpenAIError(str(e), 400) from None
    except RuntimeError as e:
        raise OpenAIError(str(e), 500) from None


def attach_dev_routes(app: FastAPI, client: AsyncLLM, metrics: ServerMetrics) -> frozenset[str]:
    """Mount the routes; their paths, which --api-key guards."""
    router = APIRouter()
    _add_sleep_and_pause_routes(router, client, metrics.sleep_operations)
    _add_worker_routes(router, client)
    _add_weight_routes(router, client, metrics.weight_operations)
    _add_weight_checker(router, client)
    _add_server_info(router, client)
    app.include_router(router)
    return frozenset(route.path for route in router.routes)


def _add_sleep_and_pause_routes(app: APIRouter, client: AsyncLLM,
                                operations: OperationMetrics) -> None:
    @app.post("/sleep")
    async def sleep(level: int = 1, mode: PauseMode = "abort"):
        with operations.record("sleep"):
            await _control(client.sleep(level, mode))
        return json_response({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None):
        with operations.record("wake"):
            awake = await _control(client.wake_up(tags or None))
        return json_response({"status": "awake" if awake else "sleeping", "tags": tags or None})

    @app.post("/release_kv_cache_memory")
    async def release_kv_cache_memory():
        with operations.record("release_kv_cache_memory"):
            await _control(client.release_kv_cache_memory())
        return json_response({"status": "kv_cache_released"})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return json_response({"is_sleeping": await _control(client.is_sleeping())})

    @app.post("/pause")
    async def pause(mode: PauseMode = "abort", clear_cache: bool = True,
                    wait_for_inflight_requests: bool = False):
        await _control(client.pause_generation(mode, clear_cache, wait_for_inflight_requests))
        return json_response({"status": "paused"})

    @app.post("/resume")
    async def resume():
        await _control(client.resume_generation())
        return json_response({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return json_response({"is_paused": await _control(client.is_paused())})


def _add_worker_routes(app: APIRouter, client: AsyncLLM) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(method: Annotated[str, Body()], args: Annotated[list, Body()] = [],  # noqa: B006 (FastAPI copies defaults)
                             kwargs: Annotated[dict, Body()] = {},  # noqa: B006
                             timeout: Annotated[float | None, Body()] = None):
        # The engines send results back as msgpack builtins: JSON values already.
        results = await _control(client.collective_rpc(method, timeout, tuple(args), kwargs))
        return json_response({"results": results})

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        # One worker an engine: no tensor or pipeline parallelism.
        dp_size = client.config.parallel_config.data_parallel_size
        return json_response({"world_size": dp_size if include_dp else 1})

    @app.post("/abort_requests")
    async def abort_requests(request_ids: Annotated[list[str] | None, Body(embed=True)] = None):
        # vLLM's: none named aborts every request in flight.
        count = await client.abort_requests(request_ids or None)
        return json_response({"status": "aborted", "aborted": count})


def _add_weight_routes(app: APIRouter, client: AsyncLLM, operations: OperationMetrics) -> None:

    @app.post("/start_weight_update")
    async def start_weight_update():
        with operations.record("start"):
            await _control(client.start_weight_update())
        return json_response({"message": "Weight update started"})

    @app.post("/start_draft_weight_update")
    async def start_draft_weight_update():
        with operations.record("start_draft"):
            await _control(client.start_draft_weight_update())
        return json_response({"message": "Draft weight update started"})

    @app.post("/update_weights")
    async def update_weights(update_info: Annotated[dict, Body(embed=True)]):
        path = update_info.get("path")
        if "names" not in update_info and (not isinstance(path, str) or not Path(path).exists()):
            raise OpenAIError('update_info must be {"path": "<a local safetensors file or '
                              'directory>"} or {"names", "dtype_names", "shapes"} of a trainer\'s '
                              f'broadcast; no such path: {path!r}', 400)
        with operations.record("update"):
            await _control(client.update_weights(update_info))
        return json_response({"message": "Weights updated"})

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: Annotated[dict, Body(embed=True)]):
        with operations.record("init"):
            await _control(client.init_weight_transfer_engine(init_info))
        return json_response({"message": "Weight transfer initialized"})

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        with operations.record("shutdown"):
            await _control(client.shutdown_weight_transfer_engine())
        return json_response({"message": "Weight transfer shut down"})

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: Annotated[str, Body(embed=True)]):
        await _control(client.update_weight_version(new_version))
        return json_response({"success": True, "new_version": new_version})

    @app.post("/finish_weight_update")
    async def finish_weight_update(weight_version: Annotated[str | None, Body(embed=True)] = None):
        with operations.record("finish"):
            await _control(client.finish_weight_update(weight_version))
        return json_response({"message": "Weight update finished"})

    @app.get("/weight_info")
    async def weight_info():
        return json_response({"weight_version": await _control(client.get_weight_version())})


def _add_weight_checker(app: APIRouter, client: AsyncLLM) -> None:
    """vLLM's: each parameter's checksum on every worker, compared with a baseline; or every
    parameter zeroed, so that a check can tell that an update brought them all."""
    @app.post("/weight_checker")
    async def weight_checker(action: Annotated[Literal["checksum", "reset", "compare"],
                                               Body(embed=True)],
                             baseline: Annotated[dict[str, str] | None, Body(embed=True)] = None):
        if action == "reset":
            await _control(client.collective_rpc("reset_weights"))
            return json_response({"status": "reset"})
        if action == "compare" and baseline is None:
            raise OpenAIError("action 'compare' requires a 'baseline' object", 400, "baseline")
        checksums = {name: digest for per_worker in await _control(
            client.collective_rpc("compute_weight_checksums")) for name, digest in
            per_worker.items()}
        if action == "checksum":
            return json_response({"checksums": checksums})
        mismatches = sorted(k for k in checksums.keys() | baseline.keys()
                            if checksums.get(k) != baseline.get(k))
        return json_response({"match": not mismatches, "mismatches": mismatches})


def _add_server_info(app: APIRouter, client: AsyncLLM) -> None:
    @app.get("/server_info")
    async def server_info(config_format: Literal["text", "json"] = "text"):
        """vLLM's: the engine config (its repr, or as JSON), the VLLM_* and MINICORE_*
        environment variables (none holding a key), and the versions that made the answer."""
        config = client.config
        env = {k: v for k, v in os.environ.items()
               if k.startswith(("VLLM_", "MINICORE_")) and "KEY" not in k}
        return json_response({
            "vllm_config": str(config) if config_format == "text"
            else json.loads(json.dumps(dataclasses.asdict(config), default=str)),
            "vllm_env": env,
            "system_env": {"minicore": minicore.__version__, "python": sys.version.split()[0],
                           "platform": platform.platform()}})
