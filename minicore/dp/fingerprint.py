"""The engine fingerprint: what every DP rank must share with rank 0, compared once at startup.

Mirrors ParallelConfig.compute_hash (vllm/config/parallel.py), whose hash every DP engine sends in
its READY message (EngineCoreProc._perform_handshakes, vllm/v1/engine/core.py) for the frontend to
compare with its own (wait_for_engine_startup, vllm/v1/engine/utils.py), so that ranks whose
collectives would differ fail at startup instead of hanging. Here the factors are kept by name,
so that a mismatch names the setting and both values, and they go beyond the parallel config:
they are whatever the ranks' collectives, the balance gate and the answer to a request depend on.
Each rank all-gathers its fingerprint over the DP group as soon as it has joined it
(the composition root, minicore/engine/components.py, for processes, headless ranks and Ray
actors alike), and every rank raises the same one-line ValueError on the first difference, before
any model loads.

Not compared, as each rank may legitimately choose its own: its KV cache size (--kv-cache-memory,
--gpu-memory-utilization, hence its number of blocks: sized to its own device; the collectives
carry request counts, never blocks, and a dummy batch uses the null block every rank has), and
how it schedules its own requests (--max-num-batched-tokens, chunked prefill, prefix caching,
--async-scheduling: they change when a request runs, not what it means nor the collectives).
Nor what only the frontend reads (--chat-template, --generation-config), nor --seed (each rank's
own random state), nor --data-parallel-size, which the group is formed from (compared in the
rendezvous store, before the group forms: dp/process_groups.py).
"""

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minicore.config import EngineConfig
from minicore.model.loader import resolve_device, resolved_dtype_name
from minicore.model.registry import runner_info

# Slices of each weights file that go into its identity: a fine-tune has its base's header and
# sizes, not its bytes.
SAMPLES_PER_FILE = 8
SAMPLE_BYTES = 4096


def engine_fingerprint(config: EngineConfig) -> dict[str, Any]:
    """This rank's factors by flag name, as plain JSON values (they travel over the DP group).
    In this order a mismatch is reported: the first that differs."""
    mc, sc, pc = config.model_config, config.scheduler_config, config.parallel_config
    spec, kvt = config.speculative_config, config.kv_transfer_config
    # auto is xgrammar, minicore's one backend.
    structured = dataclasses.asdict(config.structured_outputs_config) | {"backend": "xgrammar"}
    # Not engine_id nor the side channel: each instance's and each machine's own.
    kv = {"kv_connector": kvt.kv_connector, "kv_role": kvt.kv_role} if kvt else None
    return {
        # Which collectives a rank issues: one that issues others than its peers hangs them.
        "--runner": mc.runner,
        "--enable-expert-parallel": pc.enable_expert_parallel,
        "--balance-scheduling": sc.balance_scheduling,
        "--balance-count-sync": sc.balance_count_sync,
        # A traced rank meets its peers at startup to align its clock (minicore/tracing/clock.py).
        "--trace-steps": config.observability_config.trace_steps is not None,
        # What the balance gate compares the gathered counts with: unequal, the ranks would open
        # and close it at different counts.
        "--balance-threshold": sc.balance_threshold,
        "--max-num-seqs": sc.max_num_seqs,
        # The model, and (with expert parallelism) what every forward exchanges with the peers.
        **_model_factors(config),
        # What a request means: the frontend checks it against its own config, then any rank may
        # run it (the engine checks these again), and a KV connector's peer reads any rank's
        # blocks by their ids.
        "--max-model-len": sc.max_model_len,
        "--block-size": config.cache_config.block_size,
        "--max-logprobs": mc.max_logprobs,
        "--scheduling-policy": sc.policy,
        "--speculative-config": dataclasses.asdict(spec) if spec else None,
        "--structured-outputs-config": structured,
        "--kv-transfer-config": kv,
    }


def _model_factors(config: EngineConfig) -> dict[str, Any]:
    """The model as named and as its files are, and for a runner with weights what they load as.
    dtype and device as resolved on this rank (auto is bfloat16 on one CPU and float32 on
    another): the expert-parallel collectives exchange tensors of that dtype, on a group whose
    backend follows the device (gloo, NCCL). The KV cache takes the model's dtype (minicore has no
    --kv-cache-dtype), so --dtype covers it."""
    mc = config.model_config
    factors = {"--model": mc.model_source, "--tokenizer": mc.tokenizer,
               "model files": weights_identity(mc.model)}
    if runner_info(mc.runner).needs_weights:
        factors["--dtype"] = resolved_dtype_name(mc.dtype, mc.device)
        factors["--device"] = resolve_device(mc.device).type
    return factors


def weights_identity(model_dir: str) -> str:
    """A resolved model directory's identity, cheap whatever the model's size: sha256 (its first
    16 hex digits) of its config.json (less transformers_version, which says what saved it) and,
    of each *.safetensors file, its name, size, header (every tensor's name, dtype, shape and
    offsets) and SAMPLES_PER_FILE slices spread over its data. Not modification times, which a
    copy to another machine changes."""
    path = Path(model_dir)
    digest = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    config.pop("transformers_version", None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
            digest.update(f.read(data_start - 8))
            step = max(1, (size - data_start) // SAMPLES_PER_FILE)
            for offset in range(data_start, size, step)[:SAMPLES_PER_FILE]:
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return "sha256:" + digest.hexdigest()[:16]


def check_same_fingerprint(fingerprints: list[dict[str, Any]]) -> None:
    """fingerprints by rank: a ValueError naming the first factor of the first rank that differs
    from rank 0's, with both values. Every rank gets the same list, so every rank raises the same
    line (or none does)."""
    first = fingerprints[0]
    for rank, other in enumerate(fingerprints[1:], start=1):
        for name in {**first, **other}:
            if first.get(name) != other.get(name):
                raise ValueError(
                    f"DP ranks disagree on {name}: rank 0 has {_show(first.get(name))}, rank "
                    f"{rank} has {_show(other.get(name))}; start every rank with the same engine "
                    "arguments")


def check_dp_ranks_agree(config: EngineConfig, all_gather: Callable[[Any], list]) -> None:
    """At startup, right after the DP group forms: all_gather (DPGroup.all_gather_json) every
    rank's fingerprint and fail on the first difference from rank 0's."""
    check_same_fingerprint(all_gather(engine_fingerprint(config)))


def _show(value: Any) -> str:
    if value is None:
        return "unset (the default)"
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value)
