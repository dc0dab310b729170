"""minicore.testing: drive a scheduler step by step with a scripted fake model, for unit tests.

Mirrors nothing in vLLM directly; it plays the role of vLLM's tests/v1/core/utils.py
(create_scheduler, create_requests), as a public module so that a scheduler patch (a Scheduler or
BalanceScheduler subclass) can be tested without vLLM, a model or a device:

    s = make_scheduler(max_num_seqs=2, block_size=4, num_blocks=8)
    s.add_request(make_request("a", 6, max_tokens=2))
    st = step(s)                        # schedule() -> fake model -> update_from_output()
    assert st.scheduled == {"a": 6} and st.block_ids == {"a": [1, 2]}

The fake model follows vLLM's runner: after schedule(), a scheduled request samples one token iff
all its known tokens are computed (a request mid-prefill samples nothing: []). By default it
samples FAKE_TOKEN_BASE + its number of outputs so far; a script chooses tokens instead (see
fake_model_output), e.g. an EOS or a stop id at a chosen step. Draft tokens (speculative
decoding) are given with propose(s, {"a": [7, 8]}), as a drafter would after a step; the fake model
verifies them as a greedy runner does: a draft is accepted while it equals the token the model
would sample there, and the first one that does not is replaced by that token. With async
scheduling (make_scheduler(async_scheduling=True)) a test overlaps steps as EngineCore's batch
queue does: schedule_step() twice, then finish_step() on the first. Pure Python, like
minicore.scheduler. Left out: logits, logprobs and the sampler's masking (min_tokens: script the
tokens instead), the KV connector's worker side and the DP collectives (a test plays them:
connector= goes to the scheduler, BalanceScheduler.balance_counts is assigned by hand).
"""

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from minicore.config import CacheConfig, SchedulerConfig
from minicore.engine.components import scheduler_components
from minicore.protocol import EngineCoreOutput
from minicore.request import Request
from minicore.sampling_params import SamplingParams
from minicore.scheduler import KVCacheBlock, Scheduler, SchedulerOutput
from minicore.scheduler.interfaces import DraftTokenIds
from minicore.scheduler.output import ModelRunnerOutput

__all__ = ["FAKE_TOKEN_BASE", "Script", "Step", "block", "default_tokens", "fake_model_output",
           "finish_step", "free_ids", "make_request", "make_scheduler", "num_free", "outputs_by_id",
           "propose", "run_until_finished", "schedule_step", "step"]

# Token ids the default fake model samples: far from any small EOS or stop id a test picks.
FAKE_TOKEN_BASE = 1000

# Small defaults keep a test's numbers small: 63 usable blocks of 4 tokens (block 0 is the null
# block), 8 seats, 64-token steps and sequences. Every other knob keeps its config default.
SCHEDULER_DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64}
CACHE_DEFAULTS = {"block_size": 4, "num_blocks": 64}

# What the fake model samples: per request id, a token for this step (int) or the request's
# tokens from its first output on (a sequence: entry n is its n-th output; past the end, the
# default); or a function of the request giving this step's tokens. Ids not named: the default.
Script = Mapping[str, int | Sequence[int]] | Callable[[Request], list[int]] | None

_arrival = itertools.count(1)
_prompt_base = itertools.count(1)


def make_scheduler(*, cls: type[Scheduler] = Scheduler, **kwargs) -> Scheduler:
    """A scheduler of class cls. A keyword named like a SchedulerConfig or CacheConfig field sets
    it (policy=, enable_chunked_prefill=, block_size=, num_blocks=, balance_threshold=, ...); the
    rest go to cls (connector=, BalanceScheduler's dp_size=), but for speculative_config=, whose
    component the composition root chooses, as async_scheduling='s."""
    sched = SchedulerConfig(**{**SCHEDULER_DEFAULTS, **_take(kwargs, SchedulerConfig)})
    cache = CacheConfig(**{**CACHE_DEFAULTS, **_take(kwargs, CacheConfig)})
    components = scheduler_components(sched, kwargs.pop("speculative_config", None),
                                      has_logits=True)
    return cls(sched, cache, **components, **kwargs)


def _take(kwargs: dict, config_cls) -> dict:
    names = {f.name for f in fields(config_cls)}
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}


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
    """A request; sp_kwargs are SamplingParams fields (stop_token_ids=, ignore_eos=, ...).

    prompt is a token list, or a length: tokens first_token, first_token+1, ..., where the
    default first_token gives every request its own token range (so no accidental prefix hits).
    arrival_time defaults to an increasing counter (1.0, 2.0, ...) in creation order."""
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
    """What the fake model samples unless scripted: FAKE_TOKEN_BASE + number of outputs so far."""
    return [FAKE_TOKEN_BASE + req.num_output_tokens]


def _planned(planned: int | Sequence[int] | None, first: int, n: int) -> int:
    """The token a script plans for a request's output n (first: its outputs so far)."""
    if isinstance(planned, int):
        if n == first:
            return planned
    elif planned is not None and n < len(planned):
        return planned[n]
    return FAKE_TOKEN_BASE + n


def _sample(req: Request, script: Script, drafts: Sequence[int] = ()) -> list[int]:
    """The request's tokens this step: with drafts, those equal to the planned tokens (a greedy
    verifier's) and the planned token after them."""
    if callable(script):
        return list(script(req))
    planned = script.get(req.request_id) if script else None
    # The outputs before this step's: right after schedule() the request has computed every one
    # of them (those still in flight with async scheduling included) and its drafts.
    first = req.num_computed_tokens - len(drafts) - req.num_prompt_tokens
    tokens = [_planned(planned, first, first)]
    for draft in drafts:
        if tokens[-1] != draft:
            break
        tokens.append(_planned(planned, first, first + len(tokens)))
    return tokens


def fake_model_output(s: Scheduler, out: SchedulerOutput,
                      tokens: Script = None) -> ModelRunnerOutput:
    """What a model runner returns for out; call it right after the schedule() that made out.

    tokens is a Script: {"a": 2} makes a sample token 2 now, {"a": [5, 6, 2]} makes its first three
    outputs 5, 6, 2. A request mid-prefill samples nothing ([]) whatever the script says; one
    with drafts samples the drafts the script agrees with and one more token."""
    req_ids = list(out.num_scheduled_tokens)
    drafts = out.scheduled_spec_decode_tokens
    sampled = []
    for rid in req_ids:
        req = s.requests[rid]
        sampled.append([] if req.num_computed_tokens < req.num_tokens
                       else _sample(req, tokens, drafts.get(rid, ())))
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


@dataclass(slots=True)
class Step:
    """One step's decisions and the KV pool it left, taken after update_from_output()."""
    # Tokens scheduled per request id, in schedule order (running ones first, then admitted ones).
    scheduled: dict[str, int]
    # Admitted this step, or resumed after a preemption (sent to the runner whole).
    new: list[str]
    # Running requests the runner already knew.
    cached: list[str]
    preempted: set[str]
    # Stopped or length-capped by this step's outputs (out.finished_req_ids, the runner's view,
    # lists instead what finished before this step, aborts included).
    finished: list[str]
    # New token ids per request that produced an output (mid-prefill ones produce none).
    tokens: dict[str, list[int]]
    # What update_from_output() returned (the EngineCoreOutputs' outputs).
    outputs: list[EngineCoreOutput]
    num_free: int
    # KV block ids of every request that holds blocks, in block-table order.
    block_ids: dict[str, list[int]]
    # The SchedulerOutput itself, for what the fields above leave out.
    out: SchedulerOutput


def schedule_step(s: Scheduler, tokens: Script = None) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """schedule() and what the fake model samples for it (tokens: see Script): a step in flight,
    for finish_step."""
    out = s.schedule()
    return out, fake_model_output(s, out, tokens)


def step(s: Scheduler, tokens: Script = None) -> Step:
    """One engine step: schedule(), the fake model (tokens: see Script), update_from_output()."""
    return finish_step(s, schedule_step(s, tokens))


def finish_step(s: Scheduler, in_flight: tuple[SchedulerOutput, ModelRunnerOutput]) -> Step:
    """update_from_output() with a step's output; the record of the step."""
    out, runner_output = in_flight
    outputs = s.update_from_output(out, runner_output)
    kv = s.kv_cache_manager
    return Step(
        scheduled=out.num_scheduled_tokens,
        new=[r.req_id for r in out.scheduled_new_reqs],
        cached=list(out.scheduled_cached_reqs.req_ids),
        preempted=set(out.preempted_req_ids),
        finished=[o.request_id for o in outputs if o.finish_reason is not None],
        tokens={o.request_id: list(o.new_token_ids) for o in outputs},
        outputs=outputs,
        num_free=num_free(s),
        block_ids={rid: ids for rid in s.requests if (ids := kv.get_block_ids(rid))},
        out=out,
    )


def propose(s: Scheduler, drafts: Mapping[str, list[int]]) -> None:
    """Give requests draft tokens for their next step, as the drafter does after a step."""
    s.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))


def run_until_finished(s: Scheduler, tokens: Script = None, max_steps: int = 1000) -> list[Step]:
    """Step until no request is unfinished; returns every step's record. AssertionError if some
    request is still unfinished after max_steps."""
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return steps
        steps.append(step(s, tokens))
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def outputs_by_id(outputs: Iterable[EngineCoreOutput]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for o in outputs}


def num_free(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def free_ids(s: Scheduler) -> list[int]:
    """Free-queue block ids, head (reused first) to tail."""
    queue = s.kv_cache_manager.block_pool.free_block_queue
    return [b.block_id for b in queue.get_all_free_blocks()]


def block(s: Scheduler, block_id: int) -> KVCacheBlock:
    """The KVCacheBlock with this id (ref_cnt, block_hash, ...)."""
    return s.kv_cache_manager.block_pool.blocks[block_id]
