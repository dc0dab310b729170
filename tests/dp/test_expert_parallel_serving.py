"""Expert parallelism served (issue 13): for each supported family (DeepSeek-V3's, with its latent
attention, for DeepSeek's), a tiny random MoE model (tests/model/moe_models.py, with the default
model's tokenizer) served by two engine processes with --enable-expert-parallel gives exactly the
greedy tokens of one in-process engine without it.

The requests are spread so that the ranks' token counts differ in every step, and so that rank 1
runs dummy forwards (which must still meet rank 0's forwards in every MoE layer) both ways: with no
request, and holding a request that the balance gate keeps it from scheduling. Rank 0 runs three
requests of different lengths, which fill it (max_num_seqs 3: the gate closes on every rank), while
rank 1 idles; once rank 0 is full, rank 1 gets a request, which waits until rank 0's shortest one
ends and then runs beside the other two. Each rank says at startup which experts it kept, and
writes its steps to the run's step trace (--trace-steps, issue 46), which must show the same: both
ranks' forwards in lockstep, rank 1's dummy batches and the gate holding its request. The
random-trace tests (test_dp_traces.py) and a dying rank (test_dp_server.py) run with an EP model
too; the CLI's refusals are in tests/test_cli.py.
"""

import asyncio
import random
from collections import Counter

import pytest
from dp_helpers import (
    assert_all_engines_idle,
    dp_client,
    engine_log,
    free_port_pair,
    wait_idle,
    wait_until,
)
from moe_models import FAMILIES, tiny_moe_config

from minicore.config import create_engine_config
from minicore.llm import LLM
from minicore.model.expert_parallel import check_expert_parallel, determine_expert_map
from minicore.sampling_params import SamplingParams
from minicore.tracing.step_trace import COLLECTIVES, STEPS, read_trace

pytestmark = pytest.mark.asyncio(loop_scope="session")

# float32: the DP=2 + EP tokens equal one engine's bit for bit there (its kernels' rows barely
# change with the batch around them); in bfloat16 only with --batch-invariant, whose rows never
# do (tests/model/test_batch_invariance.py).
ENGINE_ARGS = dict(max_model_len=256, kv_cache_memory=16 << 20)
DTYPES = {"float32": {"dtype": "float32"},
          "bfloat16 batch-invariant": {"dtype": "bfloat16", "batch_invariant": True}}
# DeepSeek-V3's MoE (shared experts, grouped router, a dense first layer) under its multi-head
# latent attention. V2-Lite's shape (no q_lora, V2's router) adds nothing across ranks: its sharded
# MoE is checked in tests/model/test_expert_parallel.py, its attention in tests/model/test_mla.py.
VARIANTS = [(family, "float32") for family in [*FAMILIES, "deepseek_v3"]] + [
    ("mixtral", "bfloat16 batch-invariant")]
MAX_NUM_SEQS = 3
# (rank, prompt length, max_tokens). Rank 0's requests are sent first; GATED goes to rank 1 once
# rank 0 runs all three, and waits some 30 steps, until rank 0's 32-token request ends.
FIRST = [(0, 23, 40), (0, 5, 48), (0, 11, 32)]
GATED = (1, 9, 12)
PLAN = [*FIRST, GATED]
TIMEOUT_S = 60


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def served_tokens(client, prompts: list[list[int]], plan=PLAN
                        ) -> tuple[list[list[int]], list[int]]:
    """Every request's tokens, in plan order (rank 0's first, then the gated one, last), and rank
    1's waiting counts from its frames."""
    num_first = len(plan) - 1
    streaming: set[int] = set()

    async def run(i: int) -> list[int]:
        rank, _, max_tokens = plan[i]
        outputs = []
        async for output in client.generate(prompts[i], greedy(max_tokens), f"req-{i}",
                                            data_parallel_rank=rank):
            outputs.append(output)
            streaming.add(i)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
        return outputs[-1].outputs[0].token_ids

    rank1_waiting: list[int] = []
    process_outputs = client._process_outputs

    def tap(outputs):
        if outputs.engine_index == 1 and outputs.scheduler_stats is not None:
            rank1_waiting.append(outputs.scheduler_stats.num_waiting_reqs)
        process_outputs(outputs)

    client._process_outputs = tap
    try:
        first = [asyncio.create_task(run(i)) for i in range(num_first)]
        # A token of each, not just a frame saying "3 running": with async scheduling that frame
        # leaves before the step it counts has been through the ranks' count sync, and a gated
        # request that overtook the sync would be admitted at once. A token comes from a forward
        # that rank 1 met with a dummy one, so its next inputs are read after that sync.
        await wait_until(lambda: len(streaming) == num_first and 0 in client.latest_stats
                         and client.latest_stats[0].num_running_reqs == MAX_NUM_SEQS, 10,
                         "rank 0 runs max_num_seqs requests, each past its first token")
        gated = await run(num_first)
        return [*await asyncio.gather(*first), gated], rank1_waiting
    finally:
        del client._process_outputs


@pytest.mark.parametrize(("family", "dtype"), VARIANTS)
async def test_dp2_expert_parallel_gives_the_tokens_of_one_engine(moe_model_dir, family, dtype,
                                                                 tmp_path):
    model_dir = moe_model_dir(family)
    engine_args = {**ENGINE_ARGS, **DTYPES[dtype]}
    reference_llm = LLM(model_dir, **engine_args)
    rng = random.Random(13)
    vocab_size = reference_llm.llm_engine.model_runner.vocab_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(length)] for _, length, _ in PLAN]
    reference = [o.outputs[0].token_ids for o in reference_llm.generate(
        prompts, [greedy(max_tokens) for _, _, max_tokens in PLAN], use_tqdm=False)]
    del reference_llm

    config = create_engine_config(model=model_dir, data_parallel_size=2,
                                  data_parallel_rpc_port=free_port_pair(),
                                  enable_expert_parallel=True, balance_scheduling=True,
                                  max_num_seqs=MAX_NUM_SEQS, trace_steps=tmp_path / "trace.json",
                                  **engine_args)
    with engine_log(tmp_path / "engines.log") as log_path:
        async with dp_client(config) as client:
            got, rank1_waiting = await asyncio.wait_for(served_tokens(client, prompts),
                                                        TIMEOUT_S)
            await wait_idle(client)
            await assert_all_engines_idle(client)
    assert got == reference
    # A frame of rank 1 showed LATE waiting: a step that scheduled nothing, with a request held.
    assert 1 in rank1_waiting, rank1_waiting
    assert_lockstep_trace(read_trace(tmp_path / "trace.json"))

    # Each rank kept its share of the experts (vLLM's linear placement) and said so.
    num_experts = check_expert_parallel(tiny_moe_config(family), 2)
    log = log_path.read_text()
    for rank in range(2):
        held = determine_expert_map(2, rank, num_experts)[1].ge(0).nonzero().flatten().tolist()
        assert f"DP rank {rank}: experts {held[0]}-{held[-1]} of {num_experts}" in log


def assert_lockstep_trace(records: list[dict]) -> None:
    """The run's step trace (written by both engine processes, closed at their shutdown): each
    rank's steps, the same number of forwards per rank in each wave, rank 1's dummy batches and
    its request held by the gate, the collectives each rank waited in, and every request's track
    on its rank, beginning and ending inside that rank's steps."""
    names = {r["pid"]: r["args"]["name"] for r in records if r["name"] == "process_name"}
    assert names == {0: "DP rank 0", 1: "DP rank 1"}
    steps = {rank: [r for r in records if r["ph"] == "X" and r["tid"] == STEPS
                    and r["pid"] == rank] for rank in names}
    forwards = {rank: Counter(r["args"]["wave"] for r in rank_steps
                              if r["name"] == "dummy batch" or r["args"]["tokens"])
                for rank, rank_steps in steps.items()}
    assert forwards[0] == forwards[1] and sum(forwards[0].values()) > 0, forwards
    dummies = [r for r in steps[1] if r["name"] == "dummy batch"]
    assert dummies and any(r["args"].get("gate") == "hold" for r in dummies)
    for rank in names:
        waits = [r for r in records if r["ph"] == "X" and r["tid"] == COLLECTIVES
                 and r["pid"] == rank]
        assert {r["name"] for r in waits} == {"has_global_unfinished_reqs",
                                              "gather_running_counts"}
        assert all(r["args"]["waited_ms"] >= 0 for r in waits)
        marks = [(r["name"], r["args"]["wave"]) for r in records
                 if r["ph"] == "i" and r["pid"] == rank]
        assert marks[:2] == [("wave start", 0), ("wave end", 0)], marks
    tracks = [r for r in records if r.get("cat") == "request"]
    assert sorted((r["id"], r["ph"]) for r in tracks) == [
        (f"req-{i}", ph) for i in range(len(PLAN)) for ph in "be"]
    for track in tracks:
        rank = PLAN[int(track["id"].removeprefix("req-"))][0]
        assert track["pid"] == rank
        assert any(s["ts"] - 1e-3 <= track["ts"] <= s["ts"] + s["dur"] + 1e-3
                   for s in steps[rank]), track
