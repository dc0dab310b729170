"""Sleep mode and in-place weight loading for the model runner: its memory released and brought
back, its weights replaced from a safetensors file or from a trainer's broadcast.

Mirrors Worker.sleep / wake_up in vllm/v1/worker/gpu_worker.py (vLLM tags its allocations with
CuMemAllocator and offloads or discards them by tag) and the in-place reload RL frameworks drive
through collective_rpc. The KV cache is dropped at every level (its contents are stale after a
weight update anyway; it comes back zeroed, as vLLM's). The weights: at level 1 kept on CPU
(already in host memory), moved to pinned host memory on CUDA; at level 2 dropped, and reloaded
from the model directory on wake-up (what was loaded in place since is lost, as in vLLM). Freed
host memory goes back to the kernel (malloc_trim): the runner's heap keeps freed blocks otherwise
(minicore/model/cpu_memory.py). Weights loaded in place may come as checkpoints save them: a MoE
layer's experts one by one, stacked here as transformers holds them (expert_checkpoint.py), an
expert-parallel rank taking its own experts only. Left out: vLLM's allocator-level tagging of
every allocation.
"""

import gc
import hashlib
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from minicore.model.cpu_memory import release_freed_memory
from minicore.model.expert_checkpoint import plan_experts
from minicore.model.expert_parallel import sharded_experts_param

logger = logging.getLogger(__name__)

# How long an update waits for the engine's end of the weight transfer group to be joined.
WEIGHT_TRANSFER_JOIN_TIMEOUT_S = 300


def check_can_sleep(runner, level: int) -> None:
    """ValueError if level 2's weights could not come back."""
    config = runner.config
    if level == 2 and not Path(config.model_config.model or "").is_dir():
        raise ValueError("sleep level 2 discards the weights and reloads them from the model "
                         "directory, and this engine was given a loaded model: use level 1")
    if level == 2 and config.parallel_config.enable_expert_parallel:
        raise ValueError("sleep level 2 with expert parallelism is not supported: the reloaded "
                         "model would hold every expert; use level 1")


def release(runner, level: int) -> None:
    """The KV cache, and the weights at level 1 and 2 (level 0: release_kv_cache_memory)."""
    runner.kv_caches, runner.decode_attention = [], None
    for param in runner.model.parameters() if level else ():
        if level == 2:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        elif param.device.type == "cuda":
            param.data = param.data.to("cpu").pin_memory()
    runner.released = {"weights", "kv_cache"} if level else {"kv_cache"}
    # A DP rank asleep may still be woken for a wave a peer started before the pause reached it
    # (a request for a wave that had ended): its dummy batches then run nothing, which keeps its
    # collectives in step with the peers' (all of them, but with expert parallelism). What ran
    # before (the runner's own, or a step tracer's wrap of it) runs again on waking.
    vars(runner).setdefault("awake_dummy_batch", runner.execute_dummy_batch)
    runner.execute_dummy_batch = _nothing
    _return_memory(runner.device)


def restore(runner, tags: list[str], level: int) -> None:
    if not tags:
        return
    if "weights" in tags and level == 2:
        _reload_weights(runner)
    elif "weights" in tags:
        for param in runner.model.parameters():
            param.data = param.data.to(runner.device)
    if "kv_cache" in tags:
        runner.init_kv_cache()
    runner.released -= set(tags)
    if not runner.released and (awake := vars(runner).pop("awake_dummy_batch", None)):
        runner.execute_dummy_batch = awake
    _return_memory(runner.device)


def _nothing() -> None:
    """An asleep runner's dummy batch."""


def _reload_weights(runner) -> None:
    from minicore.model.loader import load_model

    mc = runner.config.model_config
    fresh, _ = load_model(mc.model, dtype=runner.model.dtype, device=runner.device)
    fresh_params = dict(fresh.named_parameters())
    for name, param in runner.model.named_parameters():
        param.data = fresh_params[name].data
    runner.bind_weights()


def load_weights(runner, path: str) -> int:
    """Copy the tensors of a safetensors file (or of every one in a directory) into the model's
    parameters of the same names, cast to their dtype; a MoE layer's experts saved one by one (as
    checkpoints hold them) are stacked as the model holds them, an expert-parallel rank taking its
    own experts only. Returns how many parameters it wrote. Every name and shape is checked
    first: on a mismatch, or an expert missing, nothing changes (ValueError naming it)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"load_weights: no safetensors file at {path!r}")
    owners = {name: h for h in (safe_open(f, framework="pt") for f in files) for name in h.keys()}
    shapes = {name: tuple(h.get_slice(name).get_shape()) for name, h in owners.items()}
    return _load_checked(runner, shapes, lambda name: owners[name].get_tensor(name), path)


def update_weights(runner, update_info: dict) -> int:
    """POST /update_weights on the runner: update_info {"path": ...} is load_weights', {"names",
    "dtype_names", "shapes"} announces the tensors the trainer broadcasts over the runner's
    weight transfer group (minicore/dp/weight_transfer.py), all received before any is checked,
    so that the group stays in step whatever happens here. Send updates while generation is
    paused (as RL frameworks do): the receive holds the forward thread, which a DP rank's
    collectives need while it runs."""
    if isinstance(update_info, dict) and "names" in update_info:
        if runner.weight_transfer is None:
            raise ValueError("no weight transfer group: call init_weight_transfer_engine first")
        # Joined by now unless the trainer never came (its own join waits for every rank).
        named = dict(
            runner.weight_transfer.result(WEIGHT_TRANSFER_JOIN_TIMEOUT_S).receive(update_info))
        return _load_checked(runner, {name: tuple(t.shape) for name, t in named.items()},
                             named.__getitem__, "the trainer")
    if not isinstance(update_info, dict) or not isinstance(update_info.get("path"), str):
        raise ValueError('update_info must be {"path": "<safetensors file or directory>"} or '
                         '{"names": [...], "dtype_names": [...], "shapes": [...]}')
    return load_weights(runner, update_info["path"])


def weight_checksums(runner) -> dict[str, str]:
    """Each parameter's sha256 over its bytes, named as vLLM's workers name them (their DP, PP,
    PCP and TP ranks first: vLLM's compute_tensor_digests), for POST /weight_checker."""
    prefix = f"dp{runner.config.parallel_config.data_parallel_rank}:pp0:pcp0:tp0:"
    return {prefix + name: hashlib.sha256(
        p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, p in runner.model.named_parameters()}


def reset_weights(runner) -> None:
    """Every parameter zeroed (vLLM's zero_weights), so that a check can tell that an update
    brought them all."""
    with torch.no_grad():
        for param in runner.model.parameters():
            param.zero_()
    runner.bind_weights()


def _load_checked(runner, shapes: dict[str, tuple[int, ...]],
                  read: Callable[[str], torch.Tensor], source: str) -> int:
    """The tensors of these names and shapes checked against the model's parameters, then read
    (by name) and copied into them (nothing copied on a mismatch: ValueError naming it); how many
    parameters were written."""
    loads = _plan_loads(runner.model, shapes)
    with torch.no_grad():
        for param, load in loads:
            param.copy_(load(read))
    runner.bind_weights()
    logger.info("loaded %d parameters in place from %s", len(loads), source)
    return len(loads)


def _plan_loads(model, shapes: dict[str, tuple[int, ...]]) -> list[tuple[torch.Tensor, Callable]]:
    """Each parameter to write and how its tensor is read, every name and shape checked: a
    checkpoint name as the model's own, else per-expert tensors stacked (expert_checkpoint.py); a
    stacked experts parameter on an expert-parallel rank takes the rank's experts of it."""
    # Persistent buffers too: a checkpoint holds DeepSeek-V3's router bias, a buffer here.
    params = model.state_dict(keep_vars=True)
    plain, stacked = plan_experts(name for name in shapes if name not in params)
    plain.update((name, name) for name in shapes if name in params)
    loads = []
    for name, source in plain.items():
        shape = shapes[source]
        param, experts, num_experts = _target(model, params, name, f"{source} {shape}")
        whole = tuple(param.shape) if experts is None else (num_experts, *param.shape[1:])
        if shape != whole:
            raise ValueError(f"load_weights: {source} {shape} does not fit the model ({whole})")
        loads.append((param, partial(_read_slice, source, experts)))
    for name, group in stacked.items():
        param, experts, num_experts = _target(model, params, name, min(group.found))
        if experts is None:  # the model holds every expert
            experts = range(num_experts := param.shape[0])
        try:
            group.check(num_experts)
            group.check_shapes(shapes, num_experts, tuple(param.shape[1:]))
        except ValueError as e:
            raise ValueError(f"load_weights: {e}") from None
        loads.append((param, partial(group.read, experts=experts)))
    return loads


def _target(model, params: dict, name: str,
            source: str) -> tuple[torch.Tensor, range | None, int | None]:
    """The parameter the model names name, or the slice this expert-parallel rank holds of a
    stacked experts parameter with its experts' global ids and their whole count."""
    if name in params:
        return params[name], None, None
    if sharded := sharded_experts_param(model, name):
        return sharded
    raise ValueError(f"load_weights: {source} does not fit the model (no such parameter)")


def _read_slice(name: str, experts: range | None,
                read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Tensor name, or the rows of these experts of it."""
    tensor = read(name)
    return tensor if experts is None else tensor[experts.start:experts.stop]


def _return_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        release_freed_memory()
