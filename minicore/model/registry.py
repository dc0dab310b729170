"""The model runners, by the name --runner gives, with what each can do; classes imported lazily.

Mirrors vLLM's model registry (vllm/model_executor/models/registry.py: _ModelRegistry maps an
architecture to a _LazyRegisteredModel, a module and class imported on first use, and reads
capabilities such as supports_pp from its _ModelInfo). Here the entries are minicore's runners,
and the capabilities are what the engine must know before a runner exists: whether it gives
logits (logprobs), loads weights (and so torch and a device), leaves a step time for the DP loop to
keep ranks in lockstep, and shards experts. Pure Python, importing nothing of minicore: the config
reads it for --runner's choices and checks. Left out: out-of-tree plugins.
"""

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """A runner class (by module and name, imported when first built) and its capabilities."""
    module: str
    class_name: str
    # --help text for this choice of --runner.
    help: str
    # It computes logits, so it can give logprobs and prompt logprobs.
    has_logits: bool
    # It is built on a loaded transformers model: ModelRunner(config, model, tokenizer); without,
    # Runner(config), and the engine process loads neither torch nor weights for it.
    needs_weights: bool
    # Its forwards leave their step time for the DP busy loop to all-reduce (pop_step_time),
    # standing in for the all-to-alls that keep an MoE model's ranks in lockstep.
    reports_step_time: bool
    # It can shard a mixture-of-experts model's experts over the DP ranks.
    supports_expert_parallel: bool

    def load_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


MODEL_RUNNERS: dict[str, RunnerInfo] = {
    "transformers": RunnerInfo(
        "minicore.model.runner", "ModelRunner",
        "a transformers model over minicore's paged KV cache",
        has_logits=True, needs_weights=True, reports_step_time=False,
        supports_expert_parallel=True),
    "simulated": RunnerInfo(
        "minicore.model.simulated", "SimulatedModelRunner",
        "no weights, made-up tokens after a modelled delay (minicore.model.simulated, for "
        "studying the IO path and scheduling policies); the tokenizer is still the model's",
        has_logits=False, needs_weights=False, reports_step_time=True,
        supports_expert_parallel=False),
}


def runner_info(name: str) -> RunnerInfo:
    """The registered runner of that name; ValueError naming the choices for any other."""
    try:
        return MODEL_RUNNERS[name]
    except (KeyError, TypeError):
        choices = " or ".join(repr(n) for n in MODEL_RUNNERS)
        raise ValueError(f"runner must be {choices}, got {name!r}") from None
