"""ModelRunner: owns the model and its paged KV cache; turns a SchedulerOutput into sampled tokens.

Mirrors vllm/v1/worker/gpu_model_runner.py (with gpu_worker.py's KV cache sizing): it keeps each
request's token ids and block table across steps, packs the step's tokens into one batch
(input_ids [1, T]), runs the transformers model with minicore's paged attention, computes logits
only at the positions that sample (and, for requests that ask for prompt logprobs, at their prompt
positions), and samples with minicore/model/sampler.py. The sampling metadata is rebuilt each step
from the request states (vLLM keeps it in its persistent InputBatch). Left out: CUDA graphs,
persistent input batches, speculative decoding, pipeline/tensor parallelism.
"""

import logging

import torch

from minicore.config import EngineConfig
from minicore.model.attention import (AttentionMetadata, compute_logits, kv_cache_shape,
                                      use_paged_attention)
from minicore.model.cpu_linear import use_cpu_linear
from minicore.model.cpu_memory import keep_freed_memory
from minicore.model.decode_kv import DecodeKVBuffers
from minicore.model.native import native_kernels
from minicore.model.sampler import (
    Penalties,
    SamplingMetadata,
    compute_logprobs,
    gather_logprobs,
    sample,
)
from minicore.model.runner_base import CachedRequestState, ModelRunnerBase
from minicore.outputs import ModelRunnerOutput
from minicore.protocol import LogprobsLists
from minicore.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

# Prompt positions whose logits are computed at once for prompt logprobs: [512, V] float32.
_PROMPT_LOGPROBS_SLICE = 512


class ModelRunner(ModelRunnerBase):
    def __init__(self, config: EngineConfig, model, tokenizer):
        super().__init__()
        # vLLM's --seed (set_random_seed in its worker): unseeded requests draw their sampling
        # noise from torch's default generator, so a fresh engine repeats them.
        torch.manual_seed(config.model_config.seed)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.block_size = config.cache_config.block_size
        use_paged_attention(model)
        if self.device.type == "cpu":
            keep_freed_memory()
            use_cpu_linear(model, native_kernels())
        # The base model gives hidden states; the head runs only on sampling positions.
        self.base_model = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.num_blocks = self._determine_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        # Decode attention reads per-request rows instead of gathering blocks (CPU only: see
        # decode_kv.py), with the native kernel where it builds; None runs the gather.
        self.decode_kv = (DecodeKVBuffers(self.kv_caches, kernel=native_kernels())
                          if self.device.type == "cpu" else None)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", self.num_blocks,
                    self.block_size, (self.num_blocks - 1) * self.block_size)

    # ---- KV cache sizing -----------------------------------------------------------------------

    def _kv_layout(self) -> tuple[int, int, int]:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cfg.num_hidden_layers, num_kv_heads, head_dim

    def _bytes_per_block(self) -> int:
        num_layers, num_kv_heads, head_dim = self._kv_layout()
        dtype_size = torch.tensor([], dtype=self.model.dtype).element_size()
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * dtype_size

    def _determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_memory() // self._bytes_per_block()
        else:
            num_blocks = cache.kv_cache_memory // self._bytes_per_block()
        return num_blocks

    def _profile_cuda_memory(self) -> int:
        """Bytes left for the KV cache: gpu_memory_utilization of the GPU, less what a forward of
        a full token budget peaks at (weights and activations), as vLLM's worker measures it."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        self._forward_dummy(num_tokens, self._allocate_kv_cache(1 + -(-num_tokens // self.block_size)))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * self.config.cache_config.gpu_memory_utilization) - peak)

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        num_layers, num_kv_heads, head_dim = self._kv_layout()
        shape = kv_cache_shape(num_blocks, self.block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=self.model.dtype, device=self.device)
                for _ in range(num_layers)]

    # ---- one step ------------------------------------------------------------------------------

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(self.device).manual_seed(seed)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        input_ids, computed, num_new, sampling_rows = [], [], [], []
        for row, (state, n) in enumerate(zip(states, so.num_scheduled_tokens.values())):
            start = state.num_computed_tokens
            input_ids.extend(state.token_ids[start:start + n])
            computed.append(start)
            num_new.append(n)
            # Only a request whose known tokens are all computed after this step samples; one in
            # the middle of a chunked prefill does not.
            if start + n == len(state.token_ids):
                sampling_rows.append(row)
        output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                                   [[] for _ in req_ids])
        # No forward for an empty batch: a DP rank then runs a dummy batch, which with expert
        # parallelism joins the peers' collectives in its place (minicore/dp/engine.py).
        if req_ids:
            meta = AttentionMetadata.build([s.block_ids for s in states], computed, num_new,
                                           self.kv_caches,
                                           self._plan_rows(req_ids, computed, num_new))
            hidden = self._forward(input_ids, meta)
            if sampling_rows:
                self._sample(hidden, meta.query_start_loc_cpu, states, sampling_rows, output)
            if any(s.sampling_params.prompt_logprobs is not None for s in states):
                self._prompt_logprobs(hidden, meta.query_start_loc_cpu, states, computed,
                                      num_new, output)
        return output

    def _plan_rows(self, req_ids: list[str], computed: list[int], num_new: list[int]):
        if self.decode_kv is None:
            return None
        decodes = [i for i, n in enumerate(num_new) if n == 1]
        seq_lens = [c + n for c, n in zip(computed, num_new)]
        return self.decode_kv.plan(req_ids, computed, seq_lens, decodes, set(self.requests))

    def _sample(self, hidden: torch.Tensor, query_start_loc: list[int],
                states: list[CachedRequestState], rows: list[int],
                output: ModelRunnerOutput) -> None:
        """Sample the rows whose last position is their newest token; fill output's sampled
        tokens and, for rows that asked, their logprobs."""
        logits = self._logits(hidden[[query_start_loc[row + 1] - 1 for row in rows]])
        result = sample(logits, self._sampling_metadata([states[row] for row in rows]))
        for row, token in zip(rows, result.sampled.tolist()):
            states[row].token_ids.append(token)
            output.sampled_token_ids[row] = [token]
        if result.logprobs is not None:
            output.logprobs = {
                output.req_ids[row]: result.logprobs.tolists([i], self._num_logprobs(num))
                for i, row in enumerate(rows)
                if (num := states[row].sampling_params.logprobs) is not None}

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states, finished as the model's head does (compute_logits)."""
        return compute_logits(self.model.config, self.lm_head(hidden))

    def _prompt_logprobs(self, hidden: torch.Tensor, query_start_loc: list[int],
                         states: list[CachedRequestState], computed: list[int],
                         num_new: list[int], output: ModelRunnerOutput) -> None:
        """The logprobs of the prompt tokens this step's chunk predicts, for requests that asked:
        position j's raw logits give prompt token j + 1 (vLLM: _get_prompt_logprobs_dict)."""
        chunks = {}
        for row, state in enumerate(states):
            if (num := state.sampling_params.prompt_logprobs) is None:
                continue
            start = computed[row]
            end = min(start + num_new[row], state.num_prompt_tokens - 1)
            if start < end:
                first = query_start_loc[row]
                chunks[output.req_ids[row]] = self._logprobs_of(
                    hidden[first:first + end - start], state.token_ids[start + 1:end + 1],
                    self._num_logprobs(num))
        if chunks:
            output.prompt_logprobs = chunks

    def _logprobs_of(self, hidden: torch.Tensor, token_ids: list[int],
                     num_logprobs: int) -> LogprobsLists:
        """LogprobsLists of token_ids under the raw logits of hidden's positions, a slice of
        positions at a time so that a long prompt chunk's [T, V] logits stay small."""
        result = LogprobsLists([], [], [])
        for first in range(0, len(token_ids), _PROMPT_LOGPROBS_SLICE):
            last = first + _PROMPT_LOGPROBS_SLICE
            logprobs = compute_logprobs(self._logits(hidden[first:last]))
            targets = torch.tensor(token_ids[first:last], device=self.device)
            part = gather_logprobs(logprobs, num_logprobs, targets).tolists(
                range(len(targets)), num_logprobs)
            result.logprob_token_ids += part.logprob_token_ids
            result.logprobs += part.logprobs
            result.sampled_token_ranks += part.sampled_token_ranks
        return result

    @torch.inference_mode()
    def _forward(self, input_ids: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of one packed batch."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        out = self.base_model(input_ids=ids, position_ids=meta.positions.unsqueeze(0),
                              use_cache=False, minicore_meta=meta)
        return out.last_hidden_state[0]

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        all_greedy = all(p.temperature == 0 or p.top_k == 1 for p in params)
        top_k = top_p = min_p = None
        if not all_greedy and any(p.top_k > 0 for p in params):
            # A top_k past the vocabulary keeps every token (and may not fit a tensor).
            top_k = torch.tensor([min(p.top_k, self.vocab_size) for p in params],
                                 device=self.device)
        if not all_greedy and any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=self.device)
        if not all_greedy and any(p.min_p > 0 and p.temperature > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=self.device)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        # A stop id past the vocabulary can never be sampled: nothing to mask (nor to index).
        blocked = {i: ids for i, s in enumerate(states)
                   if (ids := [t for t in s.min_tokens_blocked_ids() if t < self.vocab_size])}
        bad_words = {i: (s.sampling_params.bad_words_token_ids, s.token_ids[s.num_prompt_tokens:])
                     for i, s in enumerate(states) if s.sampling_params.bad_words_token_ids}
        asked = [self._num_logprobs(p.logprobs) for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature, top_k, top_p, generators, all_greedy, blocked, min_p,
            self._logit_bias(params), self._allowed_token_ids_mask(params), bad_words,
            self._penalties(states), max(asked, default=None))

    def _num_logprobs(self, num: int) -> int:
        """vLLM's -1: the whole vocabulary."""
        return self.vocab_size if num == -1 else num

    def _logit_bias(self, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        entries = [(row, token_id, bias) for row, p in enumerate(params) if p.logit_bias
                   for token_id, bias in p.logit_bias.items()]
        if not entries:
            return None
        rows, token_ids, biases = zip(*entries)
        return (torch.tensor(rows, device=self.device), torch.tensor(token_ids, device=self.device),
                torch.tensor(biases, dtype=torch.float32, device=self.device))

    def _allowed_token_ids_mask(self, params) -> torch.Tensor | None:
        """[B, V], True where a row with allowed_token_ids may not sample (gpu_input_batch.py)."""
        rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
        if not rows:
            return None
        mask = torch.zeros(len(params), self.vocab_size, dtype=torch.bool, device=self.device)
        mask[rows] = True
        allowed_rows = [row for row in rows for _ in params[row].allowed_token_ids]
        allowed_ids = [t for row in rows for t in params[row].allowed_token_ids]
        mask[torch.tensor(allowed_rows, device=self.device),
             torch.tensor(allowed_ids, device=self.device)] = False
        return mask

    def _penalties(self, states: list[CachedRequestState]) -> Penalties | None:
        params = [s.sampling_params for s in states]
        if all(p.presence_penalty == 0 and p.frequency_penalty == 0
               and p.repetition_penalty == 1 for p in params):
            return None
        prompts = [s.token_ids[:s.num_prompt_tokens] for s in states]
        outputs = [s.token_ids[s.num_prompt_tokens:] for s in states]

        def padded(rows: list[list[int]]) -> torch.Tensor:
            width = max(map(len, rows), default=0)
            return torch.tensor([row + [self.vocab_size] * (width - len(row)) for row in rows],
                                dtype=torch.long, device=self.device).reshape(len(rows), width)

        def per_row(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                                device=self.device)

        return Penalties(padded(prompts), padded(outputs), per_row("presence_penalty"),
                         per_row("frequency_penalty"), per_row("repetition_penalty"))

    def _forward_dummy(self, num_tokens: int, kv_caches: list[torch.Tensor]) -> None:
        """A forward of num_tokens tokens of one sequence, writing only into kv_caches."""
        num_blocks = -(-num_tokens // self.block_size)
        meta = AttentionMetadata.build([list(range(1, num_blocks + 1))], [0], [num_tokens], kv_caches)
        self._forward([0] * num_tokens, meta)

    def execute_dummy_batch(self) -> None:
        """One token through the model, its KV written to the null block (block 0), which no
        request uses: lets a DP rank with nothing to do join its peers' collectives."""
        meta = AttentionMetadata.build([[0]], [0], [1], self.kv_caches)
        self._forward([0], meta)
