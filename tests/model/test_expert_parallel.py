"""Expert parallelism on real processes: for each supported family, 2 ranks in a gloo group each
hold half the experts of a tiny random MoE model and reproduce the unsharded model's logits for
their own tokens, with different token counts per rank (one token, like a dummy batch, too), while
issuing the same collectives in the same order; each rank keeps only its experts' memory; models
expert parallelism cannot serve are refused clearly. One fork of 2 processes covers every family;
every wait is bounded."""

import multiprocessing
import queue

import pytest
import torch
from ep_workers import EXPERTS_IMPLEMENTATIONS, TOKEN_COUNTS, rank_main
from moe_models import EP_FAMILIES, build_tiny_moe, tiny_moe_config

from minicore.model.expert_parallel import (
    ExpertParallelError,
    check_expert_parallel,
    determine_expert_map,
)
from minicore.ports import free_port

RANKS = 2
TIMEOUT_S = 120



@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    """Every rank's report (see ep_workers), from one fork of both ranks."""
    root = tmp_path_factory.mktemp("moe")
    model_dirs = {family: str(build_tiny_moe(family, root / family)) for family in EP_FAMILIES}
    # Forked, as the suite's engines are (tests/conftest.py): no re-import of torch.
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, RANKS, port, model_dirs, results))
             for rank in range(RANKS)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=TIMEOUT_S) for _ in procs)
    except queue.Empty:
        pytest.fail(f"the ranks did not report within {TIMEOUT_S} s (a hung collective?)")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failed = {rank: r for rank, r in got.items() if isinstance(r, str)}
    assert not failed, "\n".join(f"rank {rank}:\n{tb}" for rank, tb in failed.items())
    return got


@pytest.mark.parametrize("family", list(EP_FAMILIES))
def test_sharded_model_gives_each_rank_the_unsharded_logits(reports, family):
    for rank in range(RANKS):
        for implementation, mismatch in reports[rank][family]["mismatch"].items():
            assert mismatch is None, f"rank {rank}, experts_implementation={implementation}"


@pytest.mark.parametrize("family", list(EP_FAMILIES))
def test_every_rank_issues_the_same_collectives(reports, family):
    per_forward = [reports[rank][family]["collectives"] for rank in range(RANKS)]
    assert per_forward[0] == per_forward[1]
    layers = reports[0][family]["num_moe_layers"]
    # One count gather per forward, then per MoE layer one gather and one reduce-scatter.
    expected = ["all_gather_single"] + ["all_gather_single", "reduce_scatter_single"] * layers
    assert per_forward[0] == [expected] * len(TOKEN_COUNTS) * len(EXPERTS_IMPLEMENTATIONS)
    assert len(expected) == reports[0][family]["collectives_per_forward"]


@pytest.mark.parametrize("family", list(EP_FAMILIES))
def test_each_rank_keeps_only_its_experts(reports, family):
    config = tiny_moe_config(family)
    num_experts = check_expert_parallel(config, RANKS)
    dense_layers = (len(getattr(config, "mlp_only_layers", None) or [])
                    + (getattr(config, "first_k_dense_replace", None) or 0))
    num_layers = config.num_hidden_layers - dense_layers
    ranges = [reports[rank][family]["local_experts"] for rank in range(RANKS)]
    # Contiguous, covering every expert once, the first E % N ranks one more.
    assert ranges == [(0, -(-num_experts // 2)), (-(-num_experts // 2), num_experts)]
    for rank, (start, stop) in enumerate(ranges):
        report = reports[rank][family]
        before, after = report["expert_params"]
        assert after * num_experts == before * (stop - start)
        assert report["expert_bytes_held"] == after * 4  # float32, no view of the whole stack
        assert report["num_moe_layers"] == num_layers


@pytest.mark.parametrize("case, message", [
    ("dense", "dense model (llama): --enable-expert-parallel needs a mixture-of-experts model"),
    ("one_expert", "over 2 ranks needs at least 2 experts per layer (one per rank); this "
                   "qwen3_moe model has 1"),
    ("no_moe_layer", "dense model (qwen2_moe): no layer of it has experts"),
])
def test_unservable_models_are_refused_on_the_group(reports, case, message):
    for rank in range(RANKS):
        assert message in reports[rank]["refusals"][case]


def test_refusals_from_the_config_alone():
    from transformers import AutoConfig

    with pytest.raises(ExpertParallelError, match=r"dense model \(llama\).*qwen3_moe"):
        check_expert_parallel(AutoConfig.for_model("llama"), 2)
    with pytest.raises(ExpertParallelError, match="does not support 'phimoe'.*mixtral"):
        check_expert_parallel(AutoConfig.for_model("phimoe", num_local_experts=8), 2)
    with pytest.raises(ExpertParallelError, match="over 8 ranks needs at least 8 .* has 4"):
        check_expert_parallel(tiny_moe_config("olmoe"), 8)
    assert check_expert_parallel(tiny_moe_config("mixtral"), 5) == 5


def test_expert_map_follows_vllm_linear_placement():
    assert [determine_expert_map(2, r, 5)[0] for r in range(2)] == [3, 2]
    assert determine_expert_map(2, 1, 5)[1].tolist() == [-1, -1, -1, 0, 1]
    maps = [determine_expert_map(3, r, 8)[1] for r in range(3)]
    assert [int((m >= 0).sum()) for m in maps] == [3, 3, 2]
    assert torch.stack([m >= 0 for m in maps]).sum(0).tolist() == [1] * 8  # each held once
