"""What every model runner shares: the interface the engine core drives, and the state it keeps.

ModelRunnerInterface is the contract between EngineCore (minicore/engine/core.py) and a runner:
ModelRunner (minicore/model/runner.py, a real transformers model, mirroring
vllm/v1/worker/gpu_model_runner.py) and SimulatedModelRunner (minicore/model/simulated.py, a
labelled simulation) implement it. ModelRunnerBase keeps each request's tokens, block table and
progress between steps from the SchedulerOutputs, as GPUModelRunner._update_states does with
CachedRequestState (vllm/v1/worker/gpu_input_batch.py). Pure Python, so the simulated runner
loads no torch. Left out: the persistent input batch and its reordering.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

from minicore.sampling_params import SamplingParams
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput


class ModelRunnerInterface(Protocol):
    # KV cache blocks, block 0 (the null block) included; known once the runner is built.
    num_blocks: int
    # Token ids the model knows: [0, vocab_size).
    vocab_size: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's batch and sample; a request mid-prefill samples nothing."""
        ...

    def execute_dummy_batch(self) -> None:
        """One token through the model with its KV written to the null block only: what a DP rank
        with nothing to do runs while its peers step (minicore/dp/engine.py)."""
        ...

    def check_can_sleep(self, level: int) -> None:
        """ValueError where the runner could not wake from sleep at level."""
        ...

    def sleep(self, level: int) -> None:
        """Release memory: the KV cache, and at level 1 and 2 the weights (EngineControl.sleep;
        level 0, the KV cache alone: release_kv_cache_memory)."""
        ...

    def wake_up(self, tags: list[str], level: int) -> None:
        """Bring back what sleep released of tags ("weights", "kv_cache")."""
        ...


@dataclass(slots=True)
class CachedRequestState:
    """What a runner remembers of a request between steps."""
    # The prompt, then the outputs so far: penalties read both parts, bad words the outputs.
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0
    eos_token_id: int | None = None
    # The real runner's torch.Generator for a seeded request.
    generator: Any = None
    # This step's draft tokens (speculative decoding), which token_ids ends with until the
    # rejection sampler puts the step's outputs in their place (vLLM: InputBatch.spec_token_ids).
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: this step's grammar bitmask row (the tokens it may sample; sampler.py's
    # GrammarRow), or None.
    grammar_bitmask: Any = None

    def min_tokens_blocked_ids(self) -> list[int]:
        """The token ids it may not sample yet: EOS (unless ignored) and the stop ids, until it
        has min_tokens outputs (vLLM's MinTokensLogitsProcessor)."""
        params = self.sampling_params
        if len(self.token_ids) - self.num_prompt_tokens >= params.min_tokens:
            return []
        eos = [] if self.eos_token_id is None or params.ignore_eos else [self.eos_token_id]
        return eos + params.stop_token_ids


class NoRunnerDrafter:
    """A runner's drafter (vLLM's GPUModelRunner.drafter) where the runner proposes nothing after
    it samples: no --speculative-config, or ngram with sync scheduling (the engine proposes)."""
    num_layers = 0  # KV caches of its own

    def propose_draft_token_ids(self, hidden, meta, states, output) -> None:
        pass


NO_RUNNER_DRAFTER = NoRunnerDrafter()


class ModelRunnerBase:
    def __init__(self):
        self.requests: dict[str, CachedRequestState] = {}

    def check_can_sleep(self, level: int) -> None:
        """ValueError where this runner could not wake from sleep at level."""

    def update_weights(self, update_info: dict) -> int:
        """Load new weights in place (ModelRunner's); a runner without weights has none."""
        raise ValueError(f"{type(self).__name__} has no weights to update")

    def sleep(self, level: int) -> None:
        """Release memory (EngineControl.sleep); a runner without weights holds none to release."""

    def wake_up(self, tags: list[str], level: int) -> None:
        """Bring back what sleep released of tags ("weights", "kv_cache")."""

    def _make_generator(self, seed: int | None) -> Any:
        """A seeded request's random generator; the real runner's is a torch.Generator."""
        return None

    def _update_states(self, so: SchedulerOutput) -> None:
        """Forget finished and preempted requests (a preempted one comes back as new), add the new
        ones, and extend the others' block tables and progress."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                new.sampling_params, new.num_prompt_tokens, new.eos_token_id,
                self._make_generator(new.sampling_params.seed))
        cached = so.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                        cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed
