"""The engine's control plane in process (minicore/engine/control.py): pause in each mode, sleep
and wake_up by tags, the guarded utility surface and collective_rpc, on the simulated runner (its
tokens are a function of the sequence, so a paused and resumed request must end as an unpaused
one does); then on the real model through LLM: the memory each sleep level releases, outputs
after waking, and the weight update from a safetensors file."""

import pytest
import torch
from safetensors.torch import save_file

from minicore.config import create_engine_config
from minicore.engine.components import make_engine_core
from minicore.engine.control import UTILITY_METHODS, call_utility
from minicore.engine.core import EngineCore
from minicore.engine.worker_rpc import PickledCallable, encode_callable
from minicore.llm import LLM
from minicore.request import Request
from minicore.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]


def engine(**engine_args) -> EngineCore:
    return make_engine_core(create_engine_config(runner="simulated", max_model_len=256,
                                                 block_size=4, **engine_args))


def add(core: EngineCore, max_tokens: int = 20) -> None:
    for i, prompt in enumerate(PROMPTS):
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True)))


def run(core: EngineCore, steps: int | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.scheduler.has_requests() and steps != 0:
        for output in core.step_fn()[0]:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        steps = None if steps is None else steps - 1
    return tokens


def merged(*runs: dict[str, list[int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for tokens in runs:
        for rid, ids in tokens.items():
            out.setdefault(rid, []).extend(ids)
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    core = engine()
    add(core)
    return run(core)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_freezes_the_requests_and_resume_finishes_them_as_if_unpaused(reference,
                                                                           clear_cache):
    core = engine()
    add(core)
    first = run(core, steps=5)
    core.pause_scheduler("keep", clear_cache)
    assert core.is_scheduler_paused() and not core.scheduler.has_requests()
    assert core.step_fn() == ([], False)  # nothing runs while paused
    kv = core.scheduler.kv_cache_manager
    # clear_cache preempts the running requests: their blocks are free until they recompute.
    assert (kv.usage == 0) == clear_cache and len(core.scheduler.requests) == 3
    core.resume_scheduler()
    assert merged(first, run(core)) == reference


def test_abort_finishes_every_request_and_frees_its_blocks():
    core = engine()
    add(core)
    run(core, steps=3)
    core.pause_scheduler("abort")
    assert core.scheduler.requests == {} and core.scheduler.kv_cache_manager.usage == 0
    core.resume_scheduler()
    add(core, max_tokens=2)  # the same ids run again
    assert all(len(ids) == 2 for ids in run(core).values())


def test_wait_in_process_with_requests_in_flight_is_refused_and_changes_nothing(reference):
    core = engine()
    add(core)
    first = run(core, steps=2)
    with pytest.raises(ValueError, match="in-process engine cannot wait"):
        core.pause_scheduler("wait")
    assert not core.is_scheduler_paused()
    assert merged(first, run(core)) == reference
    core.pause_scheduler("wait")  # nothing in flight: pauses at once
    assert core.is_scheduler_paused()


def test_bad_modes_levels_and_tags_are_refused_before_anything_changes():
    core = engine()
    add(core)
    for call, match in ((lambda: core.pause_scheduler("later"), "pause mode"),
                        (lambda: core.sleep(3), "sleep level"),
                        (lambda: core.sleep(1, "later"), "pause mode"),
                        (lambda: core.wake_up(["optimizer"]), "unknown wake_up tag")):
        with pytest.raises(ValueError, match=match):
            call()
    assert not core.is_scheduler_paused() and not core.is_sleeping()
    assert len(core.scheduler.requests) == 3


def test_sleep_pauses_until_every_tag_is_awake():
    core = engine()
    core.sleep(1)
    assert core.is_sleeping() and core.is_scheduler_paused() and core.get_sleep_level() == 1
    with pytest.raises(ValueError, match="already asleep"):
        core.sleep(2)
    with pytest.raises(ValueError, match="asleep .* wake_up resumes it"):
        core.resume_scheduler()
    core.wake_up(["weights"])
    assert core.is_sleeping() and core.is_scheduler_paused()
    core.wake_up(["kv_cache"])
    assert not core.is_sleeping() and not core.is_scheduler_paused()
    assert core.get_sleep_level() == 0
    core.pause_scheduler("keep")
    core.wake_up()  # awake already: nothing to bring back, and it resumes, as vLLM's
    assert not core.is_sleeping() and not core.is_scheduler_paused()


def test_the_utility_surface_is_the_control_methods_only():
    core = engine()
    assert {"sleep", "wake_up", "pause_scheduler", "collective_rpc", "ping"} <= UTILITY_METHODS
    for name in ("_finish_pause", "step", "add_request", "shutdown", "abort_requests",
                 "__init__", "execute_dummy_batch", "no_such_method"):
        with pytest.raises(ValueError, match="unknown utility method"):
            call_utility(core, name, [])
    with pytest.raises(ValueError, match="pause_scheduler"):
        call_utility(core, "pause_scheduler", ["keep", True, "extra"])
    assert call_utility(core, "ping", []) == "pong"
    assert call_utility(core, "is_sleeping", []) is False


def test_collective_rpc_runs_a_runner_method_or_a_function_and_guards_names(monkeypatch):
    core = engine()
    assert core.collective_rpc("check_can_sleep", args=(1,)) == [None]
    assert core.collective_rpc(lambda runner, k: runner.num_blocks * k, kwargs={"k": 2}) == [
        2 * core.model_runner.num_blocks]
    for name in ("_update_states", "num_blocks", "missing"):
        with pytest.raises(ValueError, match="no public method"):
            core.collective_rpc(name)
    with pytest.raises(TimeoutError):
        core.collective_rpc(lambda runner: __import__("time").sleep(0.5), timeout=0.05)
    # A function that came over the socket runs only where the operator allows it.
    pickled = PickledCallable(encode_callable(lambda runner: "ran").data)
    monkeypatch.delenv("MINICORE_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(ValueError, match="MINICORE_ALLOW_INSECURE_SERIALIZATION=1"):
        core.collective_rpc(pickled)
    monkeypatch.setenv("MINICORE_ALLOW_INSECURE_SERIALIZATION", "1")
    assert core.collective_rpc(pickled) == ["ran"]


def test_weight_update_calls_come_in_order():
    core = engine()
    with pytest.raises(ValueError, match="start_weight_update first"):
        core.update_weights({"path": "/nonexistent"})
    core.start_weight_update()
    with pytest.raises(ValueError, match="SimulatedModelRunner has no weights to update"):
        core.update_weights({"path": "/nonexistent"})
    core.finish_weight_update("step-7")
    assert core.get_weight_version() == "step-7"


# ---- the real model, through LLM -----------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):"]


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(TEXTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)


@pytest.mark.model
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_kv_cache_and_at_level_2_the_weights(llm, level):
    before = greedy(llm)
    runner = llm.llm_engine.model_runner
    weights = sum(p.numel() for p in runner.model.parameters())
    llm.sleep(level)
    assert llm.is_sleeping() and runner.kv_caches == []
    assert sum(p.numel() for p in runner.model.parameters()) == (weights if level == 1 else 0)
    with pytest.raises(RuntimeError, match="asleep: call wake_up"):
        llm.generate(TEXTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and len(runner.kv_caches) == runner.model.config.num_hidden_layers
    assert greedy(llm) == before
    llm.wake_up()  # awake already: changes nothing
    assert greedy(llm) == before


@pytest.mark.model
def test_release_kv_cache_memory_after_a_pause_frees_the_kv_cache_alone(llm):
    before = greedy(llm)
    runner = llm.llm_engine.model_runner
    with pytest.raises(ValueError, match="needs a completed pause"):
        llm.release_kv_cache_memory()
    llm.sleep(0)
    llm.release_kv_cache_memory()
    assert llm.is_sleeping() and runner.kv_caches == [] and runner.released == {"kv_cache"}
    assert all(p.numel() for p in runner.model.parameters())  # the weights stay
    with pytest.raises(ValueError, match="wake_up resumes it"):
        llm.resume_generation()
    assert llm.wake_up(["weights"]) is False  # the KV cache is still released
    assert llm.wake_up(["kv_cache"]) is True
    assert not llm.is_sleeping() and greedy(llm) == before
    llm.sleep(1)
    with pytest.raises(ValueError, match="memory resident"):
        llm.release_kv_cache_memory()
    llm.wake_up()


@pytest.mark.model
def test_weight_update_from_a_file_changes_outputs_to_transformers_with_the_new_weights(
        llm, tmp_path):
    runner = llm.llm_engine.model_runner
    before = greedy(llm)
    name = "model.layers.3.mlp.down_proj.weight"
    original = dict(runner.model.named_parameters())[name].detach().clone()
    bad = tmp_path / "bad.safetensors"
    save_file({name: torch.zeros(3, 3)}, str(bad))
    llm.pause_generation()
    assert llm.is_paused()
    llm.start_weight_update()
    with pytest.raises(ValueError, match="does not fit the model"):
        llm.update_weights({"path": str(bad)})
    with pytest.raises(ValueError, match="update_info must be"):
        llm.update_weights({"file": "x"})
    with pytest.raises(ValueError, match="call init_weight_transfer_engine first"):
        llm.update_weights({"names": [name], "dtype_names": ["float32"], "shapes": [[3, 3]]})
    assert torch.equal(dict(runner.model.named_parameters())[name], original)
    new = tmp_path / "new.safetensors"
    save_file({name: (original * -1.0).contiguous()}, str(new))
    llm.update_weights({"path": str(new)})
    llm.finish_weight_update("v2")
    llm.reset_prefix_cache()
    with pytest.raises(RuntimeError, match="paused: call resume_generation"):
        greedy(llm)
    llm.resume_generation()
    after = greedy(llm)
    assert after != before and llm.get_weight_version() == "v2"
    # transformers, with the same tensor replaced
    from minicore.model.loader import load_model

    model, tokenizer = load_model(dtype="float32", device="cpu")
    model.load_state_dict({name: original * -1.0}, strict=False)
    for text, ids in zip(TEXTS, after):
        prompt = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        assert out[0, prompt.shape[1]:].tolist() == ids
    save_file({name: original.contiguous()}, str(new))
    llm.start_weight_update()  # the original back, for the module
    llm.update_weights({"path": str(new)})
    llm.finish_weight_update()
    assert greedy(llm) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_level_1_moves_the_weights_to_pinned_host_memory_and_back():
    llm = LLM(dtype="float32", device="cuda", max_model_len=256, gpu_memory_utilization=0.3)
    before = greedy(llm)
    params = list(llm.llm_engine.model_runner.model.parameters())
    allocated = torch.cuda.memory_allocated()
    llm.sleep(1)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert allocated - torch.cuda.memory_allocated() >= weights
    llm.wake_up()
    assert all(p.device.type == "cuda" for p in params) and greedy(llm) == before


@pytest.mark.model
def test_an_asleep_runner_runs_no_dummy_batch_until_it_is_whole_again(llm):
    runner = llm.llm_engine.model_runner
    llm.sleep(1)
    runner.execute_dummy_batch()  # nothing to write into: it must not touch the model
    llm.wake_up(["kv_cache"])
    assert runner.execute_dummy_batch.__name__ == "_nothing"
    llm.wake_up(["weights"])
    runner.execute_dummy_batch()
    assert runner.execute_dummy_batch.__func__ is type(runner).execute_dummy_batch
