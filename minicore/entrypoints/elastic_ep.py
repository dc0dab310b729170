"""The elastic EP routes: POST /scale_elastic_ep and POST /is_scaling_elastic_ep.

Mirrors vllm/entrypoints/serve/elastic_ep/api_router.py: the body {"new_data_parallel_size": N,
"drain_timeout": seconds (default 120)}, vLLM's messages, 408 when the leaving ranks' requests
did not finish in time, 400 for what is refused (elastic EP off, a size the model or the cluster
cannot take, a scale under way); errors are OpenAI error bodies, as every minicore error. Where
vLLM answers every other request 503 while it scales (its ScalingMiddleware), minicore's wait and
go on once the ranks have re-formed the group (AsyncLLM.scale_elastic_ep).
"""

import json

from fastapi import FastAPI, Request

from minicore.engine.async_llm import DEFAULT_DRAIN_TIMEOUT_S, AsyncLLM
from minicore.entrypoints.metrics import ServerMetrics
from minicore.entrypoints.openai_errors import OpenAIError
from minicore.entrypoints.utils import json_response


def attach_elastic_ep_routes(app: FastAPI, client: AsyncLLM,
                             metrics: ServerMetrics) -> frozenset[str]:
    """The routes; returns the path --api-key guards (it resizes the deployment)."""
    @app.post("/scale_elastic_ep")
    async def scale_elastic_ep(raw_request: Request):
        new_size, drain_timeout = _scale_request(await raw_request.body())
        try:
            await client.scale_elastic_ep(new_size, drain_timeout)
        except TimeoutError as e:
            raise OpenAIError(f"Scale failed due to request drain timeout after {drain_timeout} "
                              f"seconds: {e}", 408) from None
        except ValueError as e:
            raise OpenAIError(str(e), 400, "new_data_parallel_size") from None
        metrics.add_engines(new_size)
        return json_response({"message": f"Scaled to {new_size} data parallel engines"})

    @app.post("/is_scaling_elastic_ep")
    async def is_scaling_elastic_ep():
        return json_response({"is_scaling_elastic_ep": client.is_scaling_elastic_ep})

    return frozenset({"/scale_elastic_ep"})


def _scale_request(body: bytes) -> tuple[int, int]:
    """(new_data_parallel_size, drain_timeout) of a /scale_elastic_ep body, checked as vLLM's."""
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError("Invalid JSON format", 400) from None
    if not isinstance(fields, dict) or fields.get("new_data_parallel_size") is None:
        raise OpenAIError("new_data_parallel_size is required", 400, "new_data_parallel_size")
    new_size = fields["new_data_parallel_size"]
    drain_timeout = fields.get("drain_timeout", DEFAULT_DRAIN_TIMEOUT_S)
    if not _positive_int(new_size):
        raise OpenAIError("new_data_parallel_size must be a positive integer", 400,
                          "new_data_parallel_size")
    if not _positive_int(drain_timeout):
        raise OpenAIError("drain_timeout must be a positive integer", 400, "drain_timeout")
    return new_size, drain_timeout


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
