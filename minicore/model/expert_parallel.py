"""Expert parallelism (EP) for transformers' mixture-of-experts models: each rank of a group keeps
1/N of every MoE layer's experts, and every MoE layer of every forward meets the other ranks.

Mirrors two pieces of vLLM:
- ``determine_expert_map`` of ``vllm/model_executor/layers/fused_moe/layer.py`` (FusedMoE's expert
  map, "linear" placement): rank r holds a contiguous range of experts, the first E % N ranks one
  more than the others; the map sends a global expert id to its local id, or -1 when another rank
  holds it;
- vLLM's "naive" all2all scheme (``NaiveAll2AllManager`` in
  ``vllm/distributed/device_communicators/all2all.py``), in the collective form of that file's
  ``AgRsAll2AllManager``: dispatch = all-gather every rank's tokens (hidden states, top-k expert
  ids, top-k weights) to every rank; each rank applies only its own experts to all of them (other
  experts contribute zero); combine = reduce-scatter (sum) the partial outputs so that each rank
  gets back the finished rows of its own tokens. Same math as the unsharded layer, up to the order
  of the float sums.

It works through transformers' own modules: the router (DeepSeek's grouped top-k with its
correction bias too), the shared experts (Qwen2-MoE, DeepSeek) and every dense and attention weight
stay whole on every rank; the experts module of each MoE layer (stacked
``gate_up_proj`` / ``down_proj`` parameters, ``forward(hidden_states, top_k_index,
top_k_weights)``) is sliced to this rank's experts and wrapped. Routes to another rank's expert
become transformers' own expert-parallel sentinel (local id ``num_experts``, weight 0), which each
of its experts implementations (eager, grouped_mm, batched_mm) skips or zeroes.

Ranks may bring different token counts (a dummy batch of one token, too): the counts are
all-gathered once per model forward (as vLLM's DPMetadata does), every rank's rows are padded to
the largest count for the all-gather and the padding rows are routed nowhere. Each forward issues
the same collectives in the same order on every rank: one count gather, then per MoE layer one
all-gather and one reduce-scatter.

Left out: the all-to-all schemes (pplx, DeepEP, ...), round-robin placement, EPLB (expert load
balancing and redundant experts), load-time sharding (the whole model is loaded, then sliced),
quantized experts, and training (the collectives are not differentiable).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from minicore.model.loader import resolve_device

logger = logging.getLogger(__name__)

# DeepSeek-V2/V3's MoE too: the shared experts and the grouped router stay whole on every rank.
SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "mixtral", "olmoe", "qwen2_moe",
                         "qwen3_moe")
# Where transformers' configs keep the number of routed experts.
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_STACKED_WEIGHTS = ("gate_up_proj", "down_proj")


class ExpertParallelError(ValueError):
    """A model that expert parallelism cannot serve; the message says why and what would do."""


@dataclass(slots=True)
class ExpertParallelInfo:
    """What ``shard_experts`` did on this rank."""

    ep_rank: int
    ep_size: int
    num_experts: int  # per MoE layer, over all ranks
    local_experts: range  # the global ids of the experts this rank holds
    num_moe_layers: int

    @property
    def collectives_per_forward(self) -> int:
        return 1 + 2 * self.num_moe_layers


def check_expert_parallel(config, ep_size: int) -> int:
    """Refuse, from its config alone (before any weight is loaded), a model that expert
    parallelism over ep_size ranks cannot serve; return its number of experts per MoE layer."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    num_experts = _num_experts(config)
    if not num_experts:
        raise ExpertParallelError(
            f"dense model ({model_type}): --enable-expert-parallel needs a mixture-of-experts "
            f"model (supported model types: {supported})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ExpertParallelError(
            f"expert parallelism does not support {model_type!r} models (supported model types: "
            f"{supported})")
    if num_experts < ep_size:
        raise ExpertParallelError(
            f"expert parallelism over {ep_size} ranks needs at least {ep_size} experts per layer "
            f"(one per rank); this {model_type} model has {num_experts}")
    return num_experts


def determine_expert_map(ep_size: int, ep_rank: int,
                         global_num_experts: int) -> tuple[int, torch.Tensor]:
    """vLLM's linear placement: ``(local_num_experts, expert_map)``, where expert_map[e] is the
    local id of global expert e on this rank, or -1 where another rank holds it."""
    base, remainder = divmod(global_num_experts, ep_size)
    local_num_experts = base + 1 if ep_rank < remainder else base
    start = ep_rank * base + min(ep_rank, remainder)
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.long)
    expert_map[start:start + local_num_experts] = torch.arange(local_num_experts)
    return local_num_experts, expert_map


def shard_experts(model: nn.Module, group: ProcessGroup) -> ExpertParallelInfo:
    """Keep only this rank's experts in every MoE layer of ``model`` (a loaded transformers MoE
    model) and make each layer's experts exchange tokens with the other ranks of ``group`` (gloo on
    CPU, NCCL on CUDA). Every rank of the group must call it, on the same model; from then on every
    rank must run each forward together with the others."""
    num_experts = check_expert_parallel(model.config, group.size())
    blocks = [m for m in model.modules() if is_moe_block(m)]
    if any(isinstance(block.experts, ExpertParallelExperts) for block in blocks):
        raise ExpertParallelError("the model's experts are already sharded")
    if not blocks:
        raise ExpertParallelError(
            f"dense model ({model.config.model_type}): no layer of it has experts; "
            "--enable-expert-parallel needs a mixture-of-experts model")
    counts = _ForwardTokenCounts(group)
    # Every MoE layer of one forward sees the same tokens: their counts are gathered once, by the
    # first MoE layer, and forgotten when the forward starts and ends.
    model.base_model.register_forward_pre_hook(counts.forget)
    model.base_model.register_forward_hook(counts.forget)
    return _place_experts(blocks, [block.experts for block in blocks], num_experts, counts)


def reshard_experts(model: nn.Module, source: nn.Module, group: ProcessGroup) -> ExpertParallelInfo:
    """Elastic EP: ``model``'s MoE layers (sharded) take this rank's experts over ``group``, a new
    group of another size, from ``source``, a whole copy of the same checkpoint loaded anew."""
    num_experts = check_expert_parallel(model.config, group.size())
    blocks = [m for m in model.modules()
              if isinstance(getattr(m, "experts", None), ExpertParallelExperts)]
    sources = [m.experts for m in source.modules() if is_moe_block(m)]
    counts = blocks[0].experts._counts
    counts.group = group
    counts.forget()
    return _place_experts(blocks, sources, num_experts, counts)


def _place_experts(blocks: list[nn.Module], sources: list[nn.Module], num_experts: int,
                   counts: _ForwardTokenCounts) -> ExpertParallelInfo:
    """Each block's experts: this rank's slice of its source's (transformers' whole experts
    module), exchanging tokens over the counts' group."""
    group = counts.group
    ep_rank, ep_size = group.rank(), group.size()
    local_num_experts, expert_map = determine_expert_map(ep_size, ep_rank, num_experts)
    start = int((expert_map >= 0).nonzero()[0])
    for block, source in zip(blocks, sources, strict=True):
        block.experts = ExpertParallelExperts(
            _slice_experts(source, start, local_num_experts, num_experts), expert_map, group,
            counts)
    local = range(start, start + local_num_experts)
    return ExpertParallelInfo(ep_rank, ep_size, num_experts, local, len(blocks))


def make_expert_sharder(config, new_group: Callable[[torch.device], ProcessGroup],
                        rank: int) -> Callable[[nn.Module], nn.Module]:
    """How a DP rank prepares its model, chosen once at startup: with --enable-expert-parallel,
    the expert-parallel group is made now (new_group, by every rank at the same point of its
    startup) and each MoE layer keeps this rank's experts; without, the model stays whole."""
    if not config.parallel_config.enable_expert_parallel:
        return _whole
    group = new_group(resolve_device(config.model_config.device))

    def shard(model: nn.Module) -> nn.Module:
        info = shard_experts(model, group)
        logger.info("DP rank %d: experts %d-%d of %d in each of %d MoE layers (expert parallel, "
                    "%d collectives per forward)", rank, info.local_experts.start,
                    info.local_experts.stop - 1, info.num_experts, info.num_moe_layers,
                    info.collectives_per_forward)
        return model

    return shard


def _whole(model: nn.Module) -> nn.Module:
    return model


class ExpertParallelExperts(nn.Module):
    """One MoE layer's experts across the group, vLLM's naive scheme (all-gather every rank's
    tokens, apply the local experts, reduce-scatter the partial sums). ``experts`` is transformers'
    own experts module of the layer, already sliced to this rank's experts."""

    def __init__(self, experts: nn.Module, expert_map: torch.Tensor, group: ProcessGroup,
                 counts: _ForwardTokenCounts):
        super().__init__()
        self.experts = experts
        self.register_buffer("expert_map", expert_map.to(experts.gate_up_proj.device),
                             persistent=False)
        self.group = group
        self._counts = counts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        counts, max_tokens = self._counts.get(num_tokens, hidden_states.device)
        hidden, index, weights = _all_gather_rows(
            self.group, max_tokens, hidden_states, top_k_index, top_k_weights)
        # Off-rank routes and the padding rows go to transformers' EP sentinel with weight 0.
        padding = torch.arange(max_tokens, device=counts.device) >= counts[:, None]
        local_index = self.expert_map[index]
        skip = (local_index < 0) | padding.reshape(-1, 1)
        local_index = local_index.masked_fill(skip, self.experts.num_experts)
        partial = self.experts(hidden, local_index, weights.masked_fill(skip, 0))
        mine = partial.new_empty(max_tokens, partial.shape[-1])
        dist.reduce_scatter_single(mine, partial.contiguous(), group=self.group)
        return mine[:num_tokens]


class _ForwardTokenCounts:
    """Every rank's token count in the current model forward (one all-gather per forward)."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self._counts: torch.Tensor | None = None
        self._local = self._max = 0

    def forget(self, *_hook_args) -> None:
        self._counts = None

    def get(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """The counts by rank, and their largest (read to the host once per forward)."""
        if self._counts is None:
            counts = torch.empty(self.group.size(), dtype=torch.long, device=device)
            mine = torch.tensor([num_tokens], dtype=torch.long, device=device)
            dist.all_gather_single(counts, mine, group=self.group)
            self._counts, self._local, self._max = counts, num_tokens, int(counts.max())
        elif num_tokens != self._local:
            raise RuntimeError(f"an MoE layer got {num_tokens} tokens, an earlier one of the same "
                               f"forward {self._local}: the ranks' counts would be stale")
        return self._counts, self._max


def _all_gather_rows(group: ProcessGroup, max_tokens: int,
                     *tensors: torch.Tensor) -> list[torch.Tensor]:
    """All-gather row-aligned tensors of every rank, each rank's rows padded to max_tokens: one
    collective for all of them, their rows packed side by side as bytes (dtypes may differ)."""
    columns = [t.reshape(t.shape[0], -1).contiguous().view(torch.uint8) for t in tensors]
    packed = torch.cat(columns, dim=1)
    packed = F.pad(packed, (0, 0, 0, max_tokens - packed.shape[0]))
    gathered = packed.new_empty(group.size() * max_tokens, packed.shape[1])
    dist.all_gather_single(gathered, packed, group=group)
    unpacked, offset = [], 0
    for t, column in zip(tensors, columns):
        width = column.shape[1]
        rows = gathered[:, offset:offset + width].contiguous().view(t.dtype)
        unpacked.append(rows.reshape(-1, *t.shape[1:]))
        offset += width
    return unpacked


def _num_experts(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((n for key in _NUM_EXPERTS_KEYS if (n := getattr(text_config, key, None))), 0)


def is_moe_block(module: nn.Module) -> bool:
    """A mixture-of-experts block: its experts stacked in transformers' layout, or already
    sharded here."""
    experts = getattr(module, "experts", None)
    return isinstance(experts, ExpertParallelExperts) or (
        isinstance(experts, nn.Module)
        and all(isinstance(getattr(experts, w, None), nn.Parameter) for w in _STACKED_WEIGHTS))


def sharded_experts_param(model: nn.Module,
                          name: str) -> tuple[nn.Parameter, range, int] | None:
    """Where a whole model's stacked experts parameter ``name`` (``...experts.gate_up_proj`` or
    ``...experts.down_proj``) is on this rank's sharded model: this rank's slice of it, the global
    ids of the experts the slice holds and the layer's number of experts; None for other names."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if leaf not in _STACKED_WEIGHTS or not isinstance(module, ExpertParallelExperts):
        return None
    held = module.expert_map.ge(0).nonzero().flatten().tolist()
    return getattr(module.experts, leaf), range(held[0], held[-1] + 1), len(module.expert_map)


def _slice_experts(experts: nn.Module, start: int, count: int, num_experts: int) -> nn.Module:
    """Keep experts [start, start + count) of every stacked parameter (a copy: the others' memory
    goes with the original), and tell the module that its ids are local with EP sentinels."""
    for name, param in list(experts.named_parameters(recurse=False)):
        if param.shape[0] != num_experts:
            raise ExpertParallelError(
                f"{type(experts).__name__}.{name} has shape {tuple(param.shape)}: expected "
                f"{num_experts} stacked experts on its first dimension")
        kept = param.detach()[start:start + count].clone()
        setattr(experts, name, nn.Parameter(kept, requires_grad=param.requires_grad))
    experts.num_experts = count
    experts._is_expert_parallel = True
    return experts
