"""How engine processes start (minicore/engine/launch.py's engine_start_method): vLLM's
VLLM_WORKER_MULTIPROC_METHOD, spawn unless set, fork turned into spawn for engines on CUDA; an
engine started each way serves (the rest of the suite forks them, tests/conftest.py)."""

import asyncio

import pytest
import torch

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.engine.launch import START_METHOD_ENV, engine_start_method
from minicore.sampling_params import SamplingParams


def config(**kwargs):
    return create_engine_config(runner="simulated", max_model_len=256, **kwargs)


def test_spawn_unless_asked(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert engine_start_method(config()) == "spawn"
    for method in ("fork", "spawn"):
        monkeypatch.setenv(START_METHOD_ENV, method)
        assert engine_start_method(config()) == method


def test_an_unknown_method_names_the_variable(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV} must be fork or spawn"):
        engine_start_method(config())


@pytest.mark.parametrize("device, method", [(None, "spawn"), ("cuda", "spawn"), ("cpu", "fork")])
def test_fork_becomes_spawn_for_engines_on_cuda(monkeypatch, device, method):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = create_engine_config(max_model_len=256, device=device)
    assert engine_start_method(cfg) == method


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("method", ["fork", "spawn"])
async def test_an_engine_started_each_way_serves(monkeypatch, method):
    monkeypatch.setenv(START_METHOD_ENV, method)
    client = await asyncio.wait_for(AsyncLLM.from_engine_config(config()), 120)
    try:
        assert type(client.engine_core.procs[0]).__name__ == f"{method.capitalize()}Process"
        outputs = [o async for o in client.generate([5, 6, 7], SamplingParams(max_tokens=4), "r")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    finally:
        await client.shutdown()
    assert client.engine_core.procs[0].exitcode == 0
