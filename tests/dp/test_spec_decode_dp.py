"""Speculative decoding under data parallelism with expert parallelism: two engine processes
sharing a tiny random MoE model's experts (tests/model/moe_models.py), each verifying ngram
drafts, give exactly the greedy tokens of one in-process engine without drafts.

Rank 0 runs three requests whose forwards carry different numbers of tokens from step to step
(each request's drafts come and go), while rank 1 runs one shorter request and then only dummy
forwards, which must still meet rank 0's in every MoE layer. The prompts repeat a short random
phrase, so that the ngram drafter finds matches; the test checks that drafts were verified and
some accepted on rank 0 (its SchedulerStats), so that it tests verification, not an idle drafter.
The same with async scheduling, where each rank's runner proposes its drafts as it samples. And
MTP drafts on the tiny DeepSeek-V3 with an MTP layer (tests/model/mtp_models.py): each rank runs
its MTP layer, experts whole, on its own after its forward, and never in a dummy forward, while
the model's MoE layers meet the other rank's.
"""

import asyncio
import random

import pytest
from dp_helpers import assert_all_engines_idle, dp_client, free_port_pair, wait_idle
from moe_models import build_served_moe
from mtp_models import add_mtp_layers

from minicore.config import create_engine_config
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

# float32: the DP=2 + EP tokens equal one engine's bit for bit only there (bfloat16 rows change
# with the batch around them).
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1}
# (rank, phrase length, repeats, max_tokens)
PLAN = [(0, 5, 4, 40), (0, 3, 6, 32), (0, 7, 2, 24), (1, 4, 3, 12)]
TIMEOUT_S = 90


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_dp2_expert_parallel_with_ngram_drafts_gives_the_tokens_of_one_engine(
        moe_model_dir, async_scheduling):
    stats = await _served_with_drafts(moe_model_dir("qwen3_moe"), SPECULATIVE_CONFIG,
                                      async_scheduling)
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


async def test_dp2_expert_parallel_with_mtp_drafts_gives_the_tokens_of_one_engine(
        tmp_path_factory):
    model_dir = add_mtp_layers(build_served_moe("deepseek_v3", tmp_path_factory.mktemp("mtp")))
    stats = await _served_with_drafts(str(model_dir),
                                      {"method": "mtp", "num_speculative_tokens": 2}, False)
    # Random MTP weights: the drafts are noise, verified all the same.
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts


async def _served_with_drafts(model_dir: str, speculative_config: dict, async_scheduling: bool):
    """Serves PLAN by DP=2 + EP with drafts, checks the tokens against one engine without; rank
    0's spec decode stats."""
    reference_llm = LLM(model_dir, **ENGINE_ARGS)
    vocab_size = reference_llm.llm_engine.model_runner.vocab_size
    rng = random.Random(25)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(length)] * repeats
               for _, length, repeats, _ in PLAN]
    params = [greedy(max_tokens) for *_, max_tokens in PLAN]
    reference = [o.outputs[0].token_ids
                 for o in reference_llm.generate(prompts, params, use_tqdm=False)]
    del reference_llm

    config = create_engine_config(model=model_dir, data_parallel_size=2,
                                  data_parallel_rpc_port=free_port_pair(),
                                  enable_expert_parallel=True,
                                  speculative_config=speculative_config,
                                  async_scheduling=async_scheduling, **ENGINE_ARGS)
    async with dp_client(config) as client:
        async def run(i: int) -> list[int]:
            outputs = [o async for o in client.generate(prompts[i], params[i], f"req-{i}",
                                                        data_parallel_rank=PLAN[i][0])]
            return outputs[-1].outputs[0].token_ids

        got = await asyncio.wait_for(asyncio.gather(*map(run, range(len(PLAN)))), TIMEOUT_S)
        await wait_idle(client)
        await assert_all_engines_idle(client)
        stats = client.latest_stats[0].spec_decoding_stats
    assert got == reference
    return stats
