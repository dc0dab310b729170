"""Weight updates from mixture-of-experts checkpoints (minicore/model/sleep_mode.py's load_weights,
with minicore/model/expert_checkpoint.py), on the tiny MoE models of every family expert
parallelism supports: save_pretrained writes the experts one by one (Mixtral's as w1/w3/w2 under
block_sparse_moe), the model holds them stacked. An update from another seed's checkpoint gives
that model's greedy tokens (transformers' on it, float32); an expert-parallel rank takes only its
own experts, from a per-expert checkpoint and from a stacked one (a trainer's named_parameters);
a trainer's broadcast in the per-expert layout is stacked too; a checkpoint missing an expert is
refused, naming it, with nothing changed."""

import re
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from moe_models import EP_FAMILIES, build_tiny_moe
from safetensors import safe_open
from safetensors.torch import save_file

from minicore.llm import LLM
from minicore.model import sleep_mode
from minicore.model.expert_parallel import shard_experts
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22]]
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each family's model A (seed 0) and B (seed 1), saved by save_pretrained."""
    root = tmp_path_factory.mktemp("moe_updates")
    return {family: tuple(str(build_tiny_moe(family, root / f"{family}_{seed}", seed=seed))
                          for seed in (0, 1))
            for family in EP_FAMILIES}


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                local_files_only=True).eval()


def _runner(model, weight_transfer=None) -> SimpleNamespace:
    """What load_weights and update_weights use of a runner."""
    return SimpleNamespace(model=model, bind_weights=lambda: None,
                           weight_transfer=weight_transfer)


@torch.inference_mode()
def _greedy_transformers(model) -> list[list[int]]:
    """Greedy tokens, every position's argmax (generate's min_new_tokens would mask the eos)."""
    tokens = []
    for ids in PROMPTS:
        sequence = list(ids)
        for _ in range(MAX_NEW):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
        tokens.append(sequence[len(ids):])
    return tokens


@pytest.mark.parametrize("family", list(EP_FAMILIES))
def test_an_update_from_a_per_expert_checkpoint_gives_that_models_tokens(checkpoints, family):
    first, other = checkpoints[family]
    with safe_open(f"{other}/model.safetensors", "pt") as f:
        assert any(".experts.0." in name for name in f.keys())  # the per-expert layout
    llm = LLM(_load(first), tokenizer=load_tokenizer(resolve_model_dir(), vocab_size=False),
              dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]

    def greedy() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    before = greedy()
    llm.start_weight_update()
    llm.update_weights({"path": other})
    llm.finish_weight_update()
    llm.reset_prefix_cache()
    assert greedy() == _greedy_transformers(_load(other)) != before


class _FakeGroup:
    """Rank `rank` of an expert-parallel group of `size` (load_weights meets no other rank)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = (lambda: rank), (lambda: size)


@pytest.mark.parametrize("family", list(EP_FAMILIES))
def test_an_expert_parallel_rank_takes_its_own_experts(checkpoints, family, tmp_path):
    first, other = checkpoints[family]
    whole = _load(other).state_dict()
    stacked = tmp_path / "stacked.safetensors"  # as a trainer's named_parameters name them
    save_file({name: t.contiguous() for name, t in whole.items()}, str(stacked))
    for rank in range(2):
        for source in (other, str(stacked)):
            model = _load(first)
            info = shard_experts(model, _FakeGroup(rank, 2))
            sleep_mode.load_weights(_runner(model), source)
            start, stop = info.local_experts.start, info.local_experts.stop
            for name, tensor in model.state_dict().items():
                if ".experts.experts." in name:  # this rank's slice of the stack
                    expected = whole[name.replace(".experts.experts.", ".experts.")][start:stop]
                else:
                    expected = whole[name]
                assert torch.equal(tensor, expected), (rank, source, name)


def test_a_trainers_broadcast_in_the_per_expert_layout_is_stacked(checkpoints):
    first, other = checkpoints["mixtral"]
    with safe_open(f"{other}/model.safetensors", "pt") as f:
        named = [(name, f.get_tensor(name)) for name in f.keys()]
    group = SimpleNamespace(receive=lambda update_info: named)
    joined = Future()
    joined.set_result(group)
    model = _load(first)
    written = sleep_mode.update_weights(_runner(model, joined), {"names": [n for n, _ in named]})
    assert written == len(model.state_dict())
    for name, tensor in _load(other).state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("family, dropped", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.4.w3.weight"),
    ("deepseek_v3", "model.layers.2.mlp.experts.3.down_proj.weight"),
])
def test_a_checkpoint_missing_an_expert_is_refused_with_nothing_changed(checkpoints, family,
                                                                        dropped, tmp_path):
    first, other = checkpoints[family]
    with safe_open(f"{other}/model.safetensors", "pt") as f:
        assert dropped in f.keys()
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != dropped}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = _load(first)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(f"load_weights: {dropped} is missing")):
        sleep_mode.load_weights(_runner(model), str(tmp_path))
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
