"""SimulatedModelRunner: a SIMULATED model runner. No weights, no forward: made-up tokens after a
modelled delay.

Everything it produces is a simulation, labelled as such (this docstring, and a warning in the log
when it starts). It exists for what does not need a real model: measuring the IO path between the
frontend and the engine (with zero cost it returns at once) and studying scheduling policies (with
a cost model). It implements ModelRunnerInterface (minicore/model/runner_base.py), as ModelRunner
(which mirrors vllm/v1/worker/gpu_model_runner.py) does.

- Tokens: deterministic, a hash of the request's last token and position modulo the vocabulary size
  (read from the model's config.json when there is one). It never emits the model's EOS token, so
  a simulated request ends only by max_tokens, max_model_len or a stop token id.
- Cost: each step sleeps config.model_config.simulated_cost (SimulatedCost): step_s, plus
  prefill_token_s per prefill token, plus decode_seq_s per decoding request (a request scheduled
  for exactly its one newest token). All default to 0.
- Data parallel: ranks run in lockstep, as an MoE model's all-to-alls make them: every forward
  (dummy ones too) leaves its step time for the DP busy loop to take with pop_step_time(), which
  all-reduces it (MAX) over the DP group and waits for the slowest rank's (minicore/dp/engine.py).
  An empty schedule runs no forward, as in ModelRunner.
- KV cache: cache_config.num_blocks if set, else kv_cache_memory over a nominal per-token size
  (SmolLM2-135M's K and V in float32); the blocks are only counted, never allocated.
Left out: sampling parameters (temperature, seeds, top-k/p, penalties, bias, allowed and bad words
do not change the made-up tokens). Logprobs cannot be made up honestly without logits: its
registry entry (minicore/model/registry.py) says it has none, so the InputProcessor and
EngineCore.add_request refuse a request that asks for them.
"""

import json
import logging
import time
from pathlib import Path

from minicore.config import EngineConfig
from minicore.model.runner_base import ModelRunnerBase
from minicore.scheduler.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# SmolLM2-135M (30 layers, 3 KV heads of 64) in float32: K and V bytes per token. Only a nominal
# size to turn kv_cache_memory into a number of blocks.
NOMINAL_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
# SmolLM2's, for a config without a model directory to read them from.
DEFAULT_VOCAB_SIZE = 49152
DEFAULT_EOS_TOKEN_IDS = (2,)


def next_token(token_ids: list[int], vocab_size: int, eos_token_ids: frozenset[int]) -> int:
    """The simulated token that follows token_ids: a hash of the last token and the position,
    never an EOS token."""
    # murmur3's 32-bit finalizer over (last token, position): every bit of both matters.
    h = (token_ids[-1] * 0x9E3779B1 + len(token_ids)) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    token = (h ^ (h >> 16)) % vocab_size
    while token in eos_token_ids:
        token = (token + 1) % vocab_size
    return token


def read_vocab(model: str | None) -> tuple[int, frozenset[int]]:
    """(vocab size, EOS token ids) from the model directory's config.json, else SmolLM2's."""
    path = Path(model, "config.json") if model else None
    if path is None or not path.is_file():
        return DEFAULT_VOCAB_SIZE, frozenset(DEFAULT_EOS_TOKEN_IDS)
    hf_config = json.loads(path.read_text())
    eos = hf_config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return hf_config["vocab_size"], frozenset(eos_ids)


class SimulatedModelRunner(ModelRunnerBase):
    def __init__(self, config: EngineConfig):
        super().__init__()
        self.config = config
        self.cost = config.model_config.simulated_cost
        self.block_size = config.cache_config.block_size
        self.vocab_size, self.eos_token_ids = read_vocab(config.model_config.model)
        self.num_blocks = self._determine_num_blocks()
        # Chosen once: alone, a forward sleeps its modelled time; in lockstep DP it leaves
        # (start, seconds) in _step_time until the DP loop takes it.
        lockstep = config.parallel_config.data_parallel_size > 1
        self._run_for = self._leave_step_time if lockstep else self._sleep_for
        self._step_time: tuple[float, float] | None = None
        logger.warning("SIMULATED model runner: no model runs, tokens are made up (vocab %d), "
                       "cost %s; KV cache: %d blocks of %d tokens", self.vocab_size, self.cost,
                       self.num_blocks, self.block_size)

    def _determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        return cache.num_blocks or cache.kv_cache_memory // (
            NOMINAL_KV_BYTES_PER_TOKEN * self.block_size)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        start_time = time.perf_counter()
        self._update_states(so)
        if not so.num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        num_prefill_tokens = num_decodes = 0
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            token_ids, num_computed = state.token_ids, state.num_computed_tokens
            if n == 1 and num_computed == len(token_ids) - 1:
                num_decodes += 1
            else:
                num_prefill_tokens += n
            # As in ModelRunner: only a request whose known tokens are all computed samples.
            if num_computed + n == len(token_ids):
                token = next_token(token_ids, self.vocab_size, self.eos_token_ids)
                token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        cost = self.cost
        self._run_for(start_time, cost.step_s + cost.prefill_token_s * num_prefill_tokens
                      + cost.decode_seq_s * num_decodes)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def execute_dummy_batch(self) -> None:
        """What a DP rank with nothing to do runs: one decode's worth of time."""
        self._run_for(time.perf_counter(), self.cost.step_s + self.cost.decode_seq_s)

    def _leave_step_time(self, start_time: float, seconds: float) -> None:
        """In lockstep DP the DP loop sleeps until start_time + seconds, for the slowest rank."""
        self._step_time = (start_time, seconds)

    def _sleep_for(self, start_time: float, seconds: float) -> None:
        """Sleep until start_time + seconds."""
        remaining = start_time + seconds - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def pop_step_time(self) -> tuple[float, float] | None:
        """(start, modelled seconds) of the forward that just ran in lockstep, None if none ran."""
        step_time, self._step_time = self._step_time, None
        return step_time
