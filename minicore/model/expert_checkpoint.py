"""A mixture-of-experts checkpoint's per-expert tensors, read into the stacked experts that
transformers 5 holds.

transformers 5 keeps a MoE block's experts stacked: ``experts.gate_up_proj`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``experts.down_proj`` [E, H, I]. Checkpoints hold them
one expert at a time, the published ones and save_pretrained's (which reverses its load
conversion): ``experts.{j}.gate_proj.weight``, ``up_proj``, ``down_proj`` (Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V2/V3), Mixtral's under ``block_sparse_moe`` as ``w1`` (gate), ``w3`` (up) and
``w2`` (down). The conversion is transformers' own (conversion_mapping.py: the "qwen2_moe" and
"mixtral" converters, MergeModulelist then Concatenate, and Mixtral's block_sparse_moe renamed
mlp), made here as a plan from the names alone: a loader checks every name and shape before it
reads a tensor, and reads only the experts it keeps (an expert-parallel rank: its own).
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

# One projection of one expert, as transformers names it or as Mixtral does.
_PER_EXPERT = re.compile(r"^(?P<experts>(?:.+\.)?experts)\.(?P<id>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# Each stacked parameter's parts in the order of their rows, by transformers' names or Mixtral's.
_STACKED = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
            "down_proj": (("down_proj",), ("w2",))}
# Mixtral's MoE block, which transformers 5 calls mlp.
_MIXTRAL_BLOCK = re.compile(r"(^|\.)block_sparse_moe\.")


@dataclass
class StackedExperts:
    """One stacked experts parameter, ``name`` in the model's naming, and the checkpoint's tensors
    of it: expert j's rows are those of ``{prefix}.{j}.{part}.weight`` for each of ``parts``."""

    name: str
    prefix: str
    parts: tuple[str, ...]
    found: set[str] = field(default_factory=set)

    def tensor_name(self, expert: int, part: str) -> str:
        return f"{self.prefix}.{expert}.{part}.weight"

    def check(self, num_experts: int) -> None:
        """ValueError naming the first tensor missing of experts 0 to num_experts - 1, or one of
        an expert the model does not have."""
        expected = [self.tensor_name(j, part) for j in range(num_experts) for part in self.parts]
        if missing := [name for name in expected if name not in self.found]:
            raise ValueError(f"{missing[0]} is missing: {self.name} stacks the "
                             f"{'/'.join(self.parts)} of experts 0-{num_experts - 1}")
        if extra := sorted(self.found - set(expected)):
            raise ValueError(f"{extra[0]} does not fit the model ({self.name} stacks the "
                             f"{'/'.join(self.parts)} of experts 0-{num_experts - 1})")

    def check_shapes(self, shapes: dict[str, tuple[int, ...]], num_experts: int,
                     expert_shape: tuple[int, ...]) -> None:
        """ValueError naming the first tensor whose shape does not fit one expert's slice of the
        stacked parameter, expert_shape (its parts split its rows evenly)."""
        rows, *rest = expert_shape
        expected = (rows // len(self.parts), *rest)
        for name in (self.tensor_name(j, p) for j in range(num_experts) for p in self.parts):
            if tuple(shapes[name]) != expected:
                raise ValueError(f"{name} {tuple(shapes[name])} does not fit the model "
                                 f"({expected}, one expert's of {self.name})")

    def read(self, get: Callable[[str], torch.Tensor], experts: range) -> torch.Tensor:
        """These experts' rows (each tensor read by get from its checkpoint name), stacked."""
        return torch.stack([torch.cat([get(self.tensor_name(j, part)) for part in self.parts])
                            for j in experts])


def plan_experts(names: Iterable[str]) -> tuple[dict[str, str], dict[str, StackedExperts]]:
    """A checkpoint's tensor names sorted into the plain ones (the model's name for each: Mixtral's
    block_sparse_moe renamed, to the checkpoint's) and the stacked experts parameters their
    per-expert tensors make (by the model's name)."""
    plain: dict[str, str] = {}
    stacked: dict[str, StackedExperts] = {}
    for name in names:
        if (match := _PER_EXPERT.match(name)) is None:
            plain[_renamed(name)] = name
            continue
        leaf, parts = next((leaf, parts) for leaf, styles in _STACKED.items()
                           for parts in styles if match["proj"] in parts)
        target = f"{_renamed(match['experts'])}.{leaf}"
        stacked.setdefault(target, StackedExperts(target, match["experts"], parts)).found.add(name)
    return plain, stacked


def _renamed(name: str) -> str:
    return _MIXTRAL_BLOCK.sub(r"\1mlp.", name)


def stack_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors as the model names and holds them: per-expert ones stacked (every one of
    num_experts experts there, else ValueError naming what is missing), the others as they are."""
    plain, stacked = plan_experts(tensors)
    out = {name: tensors[source] for name, source in plain.items()}
    for name, experts in stacked.items():
        experts.check(num_experts)
        out[name] = experts.read(tensors.__getitem__, range(num_experts))
    return out
