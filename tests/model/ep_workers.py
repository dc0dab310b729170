"""The rank side of the expert-parallel tests: a forked process that joins a 2-rank gloo group,
loads each tiny MoE model, runs it unsharded for reference, shards its experts and runs the same
token batches again, the ranks' batch sizes different. It reports plain values (never raises), so
the test process sees every rank's findings, and a hung collective fails on the group's timeout."""

import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# (rank 0's tokens, rank 1's tokens) per forward: a long batch next to a one-token (dummy-sized)
# one, both ways round, then equal ones.
TOKEN_COUNTS = [(7, 1), (1, 7), (5, 5)]
COLLECTIVES = ("all_gather_single", "reduce_scatter_single")
# transformers' experts implementations: each must skip the expert-parallel sentinel routes.
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


def rank_main(rank: int, size: int, port: int, model_dirs: dict[str, str], results) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=30))
        report = {family: _check_family(rank, path) for family, path in model_dirs.items()}
        report["refusals"] = _check_refusals()
        results.put((rank, report))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _check_family(rank: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from minicore.model.expert_parallel import shard_experts

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 local_files_only=True).eval()
    batches = [_token_ids(rank, step, counts[rank]) for step, counts in enumerate(TOKEN_COUNTS)]
    with torch.inference_mode():
        expected = [model(input_ids=ids).logits for ids in batches]
    expert_params_before = _expert_numel(model)
    info = shard_experts(model, dist.group.WORLD)
    mismatch, per_forward = {}, []
    for implementation in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        got, issued = [], []
        with _recording_collectives(issued), torch.inference_mode():
            for ids in batches:
                start = len(issued)
                got.append(model(input_ids=ids).logits)
                per_forward.append(issued[start:])
        mismatch[implementation] = _mismatch(got, expected)
    return {
        "mismatch": mismatch,
        "collectives": per_forward,
        "collectives_per_forward": info.collectives_per_forward,
        "num_moe_layers": info.num_moe_layers,
        "local_experts": (info.local_experts.start, info.local_experts.stop),
        "expert_params": (expert_params_before, _expert_numel(model)),
        "expert_bytes_held": _expert_storage_bytes(model),
    }


def _check_refusals() -> dict[str, str]:
    """The error each unservable model gets from shard_experts on a real group."""
    from moe_models import tiny_moe_config
    from transformers import AutoModelForCausalLM, LlamaConfig

    from minicore.model.expert_parallel import ExpertParallelError, shard_experts

    dense = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    one_expert = tiny_moe_config("qwen3_moe", num_experts=1, num_experts_per_tok=1)
    no_moe_layer = tiny_moe_config("qwen2_moe", mlp_only_layers=[0, 1, 2])
    messages = {}
    for name, config in [("dense", dense), ("one_expert", one_expert),
                         ("no_moe_layer", no_moe_layer)]:
        try:
            shard_experts(AutoModelForCausalLM.from_config(config), dist.group.WORLD)
            messages[name] = "accepted"
        except ExpertParallelError as e:
            messages[name] = str(e)
    return messages


def _token_ids(rank: int, step: int, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(3, 128, (1, count), generator=generator)


def _mismatch(got: list[torch.Tensor], expected: list[torch.Tensor]) -> str | None:
    try:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        return str(e)
    return None


def _experts_modules(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


def _expert_numel(model) -> int:
    return sum(p.numel() for m in _experts_modules(model) for p in m.parameters())


def _expert_storage_bytes(model) -> int:
    """Bytes of the storages behind the experts' parameters: a view into the unsliced weights
    would show the whole stack here."""
    return sum(p.untyped_storage().nbytes() for m in _experts_modules(model)
               for p in m.parameters())


class _recording_collectives:
    """Record the name of every collective the experts issue, in order."""

    def __init__(self, issued: list[str]):
        self.issued, self.saved = issued, {}

    def __enter__(self):
        for name in COLLECTIVES:
            self.saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._recorded(name, original))

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)

    def _recorded(self, name, original):
        def call(*args, **kwargs):
            self.issued.append(name)
            return original(*args, **kwargs)
        return call
