"""Small helpers shared by the scheduler unit tests: building a scheduler, requests, and a fake model.

The fake model follows the rule in the spec: after ``schedule()`` a scheduled request samples iff
``req.num_computed_tokens >= req.num_tokens`` (a request in the middle of a chunked prefill samples
nothing and gets ``[]``, as vLLM's runner does). No torch here.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

from minicore.config import CacheConfig, SchedulerConfig
from minicore.outputs import ModelRunnerOutput
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler import Scheduler

# Token ids the default fake model samples: far from any EOS/stop id used in the tests.
FAKE_TOKEN_BASE = 1000

_arrival = itertools.count(1)
_prompt_base = itertools.count(1)


def make_scheduler(
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    block_size: int = 4,
    num_blocks: int = 64,
    enable_prefix_caching: bool = True,
    scheduler_reserve_full_isl: bool = True,
    cls=Scheduler,
    **kwargs,
):
    sched_cfg_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ("balance_threshold",)}
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl,
        **sched_cfg_kwargs,
    )
    cc = CacheConfig(
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
    )
    return cls(sc, cc, **kwargs)


def make_request(
    request_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    cache_salt: str | None = None,
    first_token: int | None = None,
    **sp_kwargs,
) -> Request:
    """``prompt`` is a token list, or a length: tokens first_token, first_token+1, ... where the
    default first_token gives every request its own token range (so no accidental prefix hits).
    ``arrival_time`` defaults to an increasing counter (1.0, 2.0, ...) in creation order."""
    if isinstance(prompt, int):
        if first_token is None:
            first_token = 100_000 * next(_prompt_base)
        prompt = list(range(first_token, first_token + prompt))
    if arrival_time is None:
        arrival_time = float(next(_arrival))
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sp_kwargs),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


def default_tokens(req: Request) -> list[int]:
    """Deterministic one-token output: FAKE_TOKEN_BASE + number of outputs so far."""
    return [FAKE_TOKEN_BASE + req.num_output_tokens]


def fake_model_output(
    s, out, tokens: Callable[[Request], list[int]] | dict[str, list[int]] | None = None
) -> ModelRunnerOutput:
    """What a model runner returns for ``out``; call right after ``schedule()``.

    ``tokens`` maps a request to the tokens it samples (a callable, or a dict id -> list consumed
    one per sampling step). Requests mid-prefill get ``[]``.
    """
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = s.requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
        elif tokens is None:
            sampled.append(default_tokens(req))
        elif callable(tokens):
            sampled.append(list(tokens(req)))
        else:
            seq = tokens.get(rid)
            if seq is None:
                sampled.append(default_tokens(req))
            else:
                sampled.append([seq[req.num_output_tokens]])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(s, tokens=None):
    """One engine step: schedule, fake forward, update. Returns (scheduler_output, engine_outputs)."""
    out = s.schedule()
    mro = fake_model_output(s, out, tokens)
    eco = s.update_from_output(out, mro)
    return out, eco


def outputs_by_id(engine_outputs: Iterable) -> dict:
    return {o.request_id: o for o in engine_outputs}


def new_req_ids(out) -> list[str]:
    return [r.req_id for r in out.scheduled_new_reqs]


def cached_req_ids(out) -> list[str]:
    return list(out.scheduled_cached_reqs.req_ids)


def free_ids(s) -> list[int]:
    """Free-queue block ids, head to tail."""
    return [b.block_id for b in s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]


def num_free(s) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def block(s, block_id: int):
    """The KVCacheBlock with this id (vLLM's BlockPool keeps them in ``.blocks``)."""
    return s.kv_cache_manager.block_pool.blocks[block_id]


def spy_unscheduled_victims(s) -> list[str]:
    """Record the ids of priority victims that were unscheduled after being scheduled in the same
    step (the scheduler calls kv_cache_manager.uncache_blocks_after for exactly those); returns
    the list it appends to."""
    kv = s.kv_cache_manager
    calls: list[str] = []
    original = kv.uncache_blocks_after

    def spy(request, num_computed_tokens):
        calls.append(request.request_id)
        return original(request, num_computed_tokens)

    kv.uncache_blocks_after = spy
    return calls


def run_until_finished(s, tokens=None, max_steps: int = 1000):
    """Step until no unfinished requests; returns the list of (out, engine_outputs) per step."""
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return steps
        steps.append(step(s, tokens))
    raise AssertionError("requests did not finish")
