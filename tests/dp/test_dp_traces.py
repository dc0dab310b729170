"""Random request traces through AsyncLLM against real DP engine processes (SIMULATED
runner, real gloo), DP size 2 and 3, balance scheduling off and on; and DP size 2 with balance
scheduling serving the tiny DeepSeek-V3 (tests/model/moe_models.py: latent attention, shared
experts, grouped router, a dense first layer) with expert parallelism, whose every forward, dummy
ones included, meets the other rank in each MoE layer (two traces: each seed's and the next one's).

Every rank must issue the same collectives in the same order whatever reaches it: a mismatch is a
hang, not an error. So the traces mix what makes ranks diverge: bursts with random prompt lengths
and max_tokens (requests end at different steps on different ranks), staggered arrivals, requests
aborted mid-stream (client.abort, or closing the iterator), bursts that leave a rank out, one case
whose last rank receives nothing at all, and bursts sent while the previous wave is winding down.
Each trace runs under a time bound, so a collective mismatch fails fast. The seed is in the test
id; more seeds: MINICORE_DP_TRACE_SEEDS=1,2,3 pytest tests/dp/test_dp_traces.py. Tokens are checked
against the simulated model's, or against the greedy tokens of one in-process engine of the same
MoE model without expert parallelism.
"""

import asyncio
import contextlib
import functools
import os
import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
import pytest_asyncio
from dp_helpers import (
    assert_all_engines_idle,
    dp_client,
    free_port_pair,
    simulated_dp_config,
    simulated_tokens,
    wait_idle,
)

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.llm import LLM
from minicore.model.simulated import read_vocab
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

SEEDS = [int(s) for s in os.environ.get("MINICORE_DP_TRACE_SEEDS", "0").split(",")]
TRACE_TIMEOUT_S = 60
# Long enough that an aborted request is still running when the abort arrives (>= 2 s of steps).
ABORTED_MAX_TOKENS = 1000
# (DP size, balance scheduling): the cases whose last rank gets no request in the whole trace.
SILENT_LAST_RANK = {(2, True), (3, False)}
# The expert-parallel cases: room for an aborted request's ABORTED_MAX_TOKENS.
# float32: exact tokens across layouts hold bit for bit only there.
EP_ENGINE_ARGS = dict(dtype="float32", max_model_len=1200, kv_cache_memory=64 << 20)
# client.abort mid-stream; the consumer closes the stream mid-stream; client.abort right after the
# request is sent (the engine likely takes the ADD and the ABORT in one go: woken, nothing to run).
ABORT_KINDS = ("abort", "close", "early")


@pytest_asyncio.fixture(scope="module", loop_scope="session",
                        params=[(2, False, None), (2, True, None), (3, False, None),
                                (3, True, None), (2, True, "deepseek_v3")],
                        ids=["dp2", "dp2-balance", "dp3", "dp3-balance", "dp2-balance-ep"])
async def client(request):
    size, balance, moe_family = request.param
    # max_num_seqs=4: bursts overflow a rank, so requests wait, and with balance scheduling the
    # gate (>= 3 running on any rank) closes and opens during the trace.
    if moe_family is None:
        config = simulated_dp_config(size, step_s=0.002, balance_scheduling=balance,
                                     max_num_seqs=4)
    else:
        model_dir = request.getfixturevalue("moe_model_dir")(moe_family)
        config = create_engine_config(
            model=model_dir, data_parallel_size=size, data_parallel_rpc_port=free_port_pair(),
            enable_expert_parallel=True, balance_scheduling=balance, max_num_seqs=4,
            **EP_ENGINE_ARGS)
    async with dp_client(config) as client:
        yield client


def sampling(max_tokens: int) -> SamplingParams:
    """Greedy and blind to EOS, so a real model's tokens are reproducible and run to max_tokens
    (the simulated runner makes its tokens up either way)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def expected_tokens(client: AsyncLLM, asks: list[tuple[list[int], int]]) -> list[list[int]]:
    """For each (prompt, n): the first n tokens the engines must give after prompt."""
    if client.config.model_config.runner == "simulated":
        return [simulated_tokens(client, prompt, n) for prompt, n in asks]
    return greedy_reference(client.config.model_config.model).tokens(asks)


@functools.cache
def greedy_reference(model_dir: str) -> "GreedyReference":
    return GreedyReference(model_dir)


class GreedyReference:
    """Greedy continuations from one in-process engine of the model, without expert parallelism,
    kept per prompt: a longer continuation answers for a shorter one."""

    def __init__(self, model_dir: str):
        self.llm = LLM(model_dir, **EP_ENGINE_ARGS)
        self.continuations: dict[tuple[int, ...], list[int]] = {}

    def tokens(self, asks: list[tuple[list[int], int]]) -> list[list[int]]:
        needed: dict[tuple[int, ...], int] = {}
        for prompt, n in asks:
            if len(self.continuations.get(key := tuple(prompt), [])) < n:
                needed[key] = max(n, needed.get(key, 0))
        if needed:  # one batch for all: one request at a time would take longer than the trace
            outputs = self.llm.generate([list(p) for p in needed],
                                        [sampling(n) for n in needed.values()], use_tqdm=False)
            for key, output in zip(needed, outputs):
                self.continuations[key] = output.outputs[0].token_ids
        return [self.continuations.get(tuple(prompt), [])[:n] for prompt, n in asks]


# ---- the trace ---------------------------------------------------------------------------------

@dataclass
class PlannedRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    rank: int | None  # None: the frontend's load balancer picks
    delay_s: float  # arrival within its burst
    abort: str | None = None  # one of ABORT_KINDS
    abort_after: int = 0  # tokens seen before aborting ("abort" and "close")


@dataclass
class Burst:
    requests: list[PlannedRequest]
    # Wait for the previous wave to complete first; else start as soon as the previous burst's
    # requests have finished, while the engines still run the wave's dummy steps (or just ended it).
    idle_before: bool


def plan_trace(rng: random.Random, size: int, silent_rank: int | None, vocab_size: int,
               num_bursts: int = 5) -> list[Burst]:
    """The whole trace, drawn up front, so that a seed names the same trace whatever the timing."""
    skip_burst = rng.randrange(num_bursts)
    prompts: list[list[int]] = []
    bursts = []
    for b in range(num_bursts):
        left_out = silent_rank if silent_rank is not None else (
            rng.randrange(size) if b == skip_burst else None)
        allowed = [r for r in range(size) if r != left_out]
        requests = []
        for i in range(rng.randint(2, 8)):
            if prompts and rng.random() < 0.25:
                prompt = rng.choice(prompts)  # a prefix-cache hit on some rank
            else:
                prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 48))]
                prompts.append(prompt)
            explicit = left_out is not None or rng.random() < 0.5
            # At least one abort of each kind per trace (bursts 1 to 3), more at random.
            abort = (ABORT_KINDS[b - 1] if i == 0 and 1 <= b <= len(ABORT_KINDS) else
                     rng.choice(ABORT_KINDS) if rng.random() < 0.15 else None)
            requests.append(PlannedRequest(
                request_id=f"b{b}-r{i}", prompt=prompt,
                max_tokens=ABORTED_MAX_TOKENS if abort else rng.randint(1, 40),
                rank=rng.choice(allowed) if explicit else None,
                delay_s=rng.choice([0.0, 0.0, rng.uniform(0, 0.05)]),
                abort=abort, abort_after=rng.randint(1, 8)))
        bursts.append(Burst(requests, idle_before=b == 0 or rng.random() < 0.75))
    return bursts


async def run_request(client: AsyncLLM, req: PlannedRequest, outputs: dict) -> None:
    await asyncio.sleep(req.delay_s)
    seen = outputs[req.request_id] = []
    stream = client.generate(req.prompt, sampling(req.max_tokens), req.request_id,
                             data_parallel_rank=req.rank)
    aborted = False

    async def consume():
        nonlocal aborted
        async with contextlib.aclosing(stream):
            async for output in stream:
                seen.append(output)
                if (req.abort in ("abort", "close") and not aborted
                        and len(output.outputs[0].token_ids) >= req.abort_after):
                    if req.abort == "close":
                        break  # aclosing aborts it in the engine
                    await client.abort(req.request_id)
                    aborted = True  # the stream still ends, with finish_reason "abort"

    consumer = asyncio.create_task(consume())
    if req.abort == "early":
        await asyncio.sleep(0)  # the consumer's first step sends the request
        assert req.request_id in client.output_processor.request_states, (
            "the request was not sent yet")
        await client.abort(req.request_id)
    await consumer


async def run_trace(client: AsyncLLM, bursts: list[Burst], outputs: dict) -> list[int]:
    """Run the bursts; returns the coordinator's wave number at each idle point."""
    waves = []
    for burst in bursts:
        if burst.idle_before:
            await wait_idle(client)
            waves.append(client.engine_core.coordinator.current_wave)
        await asyncio.gather(*(run_request(client, r, outputs) for r in burst.requests))
    await wait_idle(client)
    waves.append(client.engine_core.coordinator.current_wave)
    return waves


class EngineOutputTap:
    """Records every engine output the frontend receives, (engine, finished) per request id,
    before the frontend drops what it no longer wants: duplicates show up here."""

    def __init__(self, client: AsyncLLM):
        self.by_request: dict[str, list[tuple[int, bool]]] = defaultdict(list)
        self._handle = client._process_outputs

    def __call__(self, outputs):
        for output in outputs.outputs:
            self.by_request[output.request_id].append((outputs.engine_index, output.finished))
        self._handle(outputs)


def describe_stuck(client: AsyncLLM) -> str:
    unfinished = {rid: state.engine_index
                  for rid, state in client.output_processor.request_states.items()}
    alive = {rank: proc.is_alive() for rank, proc in client.engine_core.procs.items()}
    c = client.engine_core.coordinator
    return (f"unfinished requests by engine {unfinished}, coordinator wave {c.current_wave} "
            f"running {c.engines_running}, engine processes alive {alive}")


# ---- the checks --------------------------------------------------------------------------------

def final_tokens(outputs) -> list[int]:
    return outputs[-1].outputs[0].token_ids if outputs else []


def check_request(req: PlannedRequest, outputs, expected, finishes, tap, engine_of) -> None:
    """expected: the reference's tokens, as many as the request got."""
    rid = req.request_id
    assert finishes[rid] == ["abort" if req.abort else "length"], (rid, finishes[rid])
    final = outputs[-1].outputs[0] if outputs else None
    tokens = final_tokens(outputs)
    assert tokens == expected, f"{rid}: tokens differ from the reference's"
    assert [o.finished for o in outputs[:-1]] == [False] * (len(outputs) - 1), rid
    if req.abort is None:
        assert outputs[-1].finished and final.finish_reason == "length", (rid, final)
        assert len(tokens) == req.max_tokens, rid
    elif req.abort in ("abort", "early"):
        assert outputs[-1].finished and final.finish_reason == "abort", (rid, final)
    else:
        assert not outputs[-1].finished, rid  # the consumer left before any end
    # The engine side: one engine per request (the explicit rank if any), one finished output
    # for a normal request (none for an aborted one: the engine never reached max_tokens), and
    # nothing after it.
    engine_outputs = tap.by_request[rid]
    assert {e for e, _ in engine_outputs} <= {engine_of[rid]}, (rid, engine_outputs)
    if req.rank is not None:
        assert engine_of[rid] == req.rank, rid
    finished_flags = [f for _, f in engine_outputs]
    if req.abort is None:
        assert finished_flags.count(True) == 1 and finished_flags[-1], (rid, finished_flags)
    else:
        assert True not in finished_flags, (rid, finished_flags)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
async def test_random_trace(client, seed):
    # The expert-parallel case runs the next seed's trace too: its engines take longer to start
    # than a trace takes to run.
    extra = [seed + 1] if client.config.parallel_config.enable_expert_parallel else []
    for trace_seed in [seed, *extra]:
        await run_and_check_trace(client, trace_seed)


async def run_and_check_trace(client: AsyncLLM, seed: int) -> None:
    size = client.num_engines
    balance = client.config.scheduler_config.balance_scheduling
    silent_rank = size - 1 if (size, balance) in SILENT_LAST_RANK else None
    vocab_size = min(read_vocab(client.config.model_config.model)[0], client.vocab_size)
    bursts = plan_trace(random.Random(seed), size, silent_rank, vocab_size)
    print(f"trace seed={seed} dp={size} balance={balance} silent_rank={silent_rank}: "
          f"{[len(b.requests) for b in bursts]} requests per burst, idle before "
          f"{[b.idle_before for b in bursts]}")

    outputs: dict[str, list] = {}
    finishes: dict[str, list[str]] = defaultdict(list)
    engine_of: dict[str, int] = {}

    def on_finished(state):
        finishes[state.request_id].append(state.finish_reason)
        engine_of[state.request_id] = state.engine_index

    tap = EngineOutputTap(client)
    client._process_outputs, client.output_processor.on_request_finished = tap, on_finished
    sent_before = list(client.engine_core.coordinator.num_sent)
    try:
        waves = await asyncio.wait_for(run_trace(client, bursts, outputs), TRACE_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(f"seed {seed}: the trace hung (a collective mismatch?): "
                             f"{describe_stuck(client)}") from None
    finally:
        del client._process_outputs
        client.output_processor.on_request_finished = None

    requests = [r for b in bursts for r in b.requests]
    assert sorted(outputs) == sorted(finishes) == sorted(r.request_id for r in requests)
    expected = expected_tokens(client, [(r.prompt, len(final_tokens(outputs[r.request_id])))
                                        for r in requests])
    for req, tokens in zip(requests, expected):
        check_request(req, outputs[req.request_id], tokens, finishes, tap, engine_of)
    # Each burst after an idle point started a wave that ended before the next idle point.
    assert waves == sorted(set(waves)) and len(waves) == 1 + sum(b.idle_before for b in bursts), \
        f"wave numbers at the idle points: {waves}"
    if silent_rank is not None:
        assert client.engine_core.coordinator.num_sent[silent_rank] == sent_before[silent_rank]
        assert silent_rank not in engine_of.values()
    else:
        assert set(engine_of.values()) == set(range(size)), "a rank got no request at all"
    await assert_all_engines_idle(client)


async def test_request_for_a_stale_wave_completes(client):
    """The frontend still believes the wave runs (it has not yet read wave_complete) and sends a
    request with the old wave number and no START_DP_WAVE: the rank it reaches must ask for the
    others (start_wave), or it would run its collectives alone."""
    # A wave of its own first: pytest-xdist may run this client's traces on the other test
    # process, leaving this one a client that has completed none.
    async for _ in client.generate([11, 12], sampling(2), "first-wave", data_parallel_rank=0):
        pass
    await wait_idle(client)
    coordinator = client.engine_core.coordinator
    wave = coordinator.current_wave
    assert wave >= 1, "the engines must have completed a wave already"
    coordinator.current_wave, coordinator.engines_running = wave - 1, True
    prompt = [11, 12, 13]
    params = sampling(20)

    async def run() -> list:
        return [o async for o in client.generate(prompt, params, f"stale-{wave}",
                                                 data_parallel_rank=1)]

    outputs = await asyncio.wait_for(run(), 30)
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length"
    assert [final.token_ids] == expected_tokens(client, [(prompt, 20)])
    # Rank 1's start_wave moved the frontend to the engines' wave; that wave then completed.
    await wait_idle(client)
    assert coordinator.current_wave == wave + 1
    await assert_all_engines_idle(client)
