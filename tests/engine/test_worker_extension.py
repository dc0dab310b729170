"""--worker-extension-cls / LLM(worker_extension_cls=): the class's methods join the model
runner's, callable by name through collective_rpc, offline and served (the hook verl and OpenRLHF
sync weights through); a class that cannot be imported, or would replace a runner method, is
refused before the engine starts."""

import httpx
import pytest
from server_helpers import ServerProcess

from minicore.llm import LLM


@pytest.mark.model
def test_offline_an_extension_method_runs_on_the_runner(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, max_model_len=128, kv_cache_memory=8 << 20,
              worker_extension_cls="worker_extension.Probe")
    assert llm.collective_rpc("probe", args=(3,)) == [[True, 6, True]]


def test_served_it_runs_through_collective_rpc(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with ServerProcess("--runner", "simulated", "--worker_extension_cls",
                       "worker_extension.Probe") as server:
        rpc = httpx.post(server.url + "/collective_rpc", json={"method": "probe", "args": [5]},
                         timeout=60)
    assert rpc.json() == {"results": [[True, 10, True]]}


@pytest.mark.parametrize("name, message", [
    ("worker_extension.Clashing", "would replace the runner's execute_model"),
    ("no_such_package.Extension", "could not be imported"),
    ("worker_extension.Missing", "could not be imported"),
    ("Probe", "'package.module.Class'"),
])
def test_bad_extensions_are_refused_by_name(name, message):
    with pytest.raises(ValueError, match=message):
        LLM(runner="simulated", worker_extension_cls=name)
