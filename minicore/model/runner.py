"""ModelRunner: owns the model and its paged KV cache; turns a SchedulerOutput into sampled tokens.

Mirrors vllm/v1/worker/gpu_model_runner.py (with gpu_worker.py's KV cache sizing): it keeps each
request's token ids and block table across steps, packs the step's tokens into one batch
(input_ids [1, T]), runs the transformers model with minicore's paged attention, computes logits
only at the positions that sample, and samples. Left out: CUDA graphs, persistent input batches,
logprobs, speculative decoding, pipeline/tensor parallelism.
"""

import logging

import torch

from minicore.config import EngineConfig
from minicore.model.attention import (AttentionMetadata, compute_logits, kv_cache_shape,
                                      use_paged_attention)
from minicore.model.sampler import SamplingMetadata, sample
from minicore.model.runner_base import CachedRequestState, ModelRunnerBase
from minicore.outputs import ModelRunnerOutput
from minicore.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


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
        # The base model gives hidden states; the head runs only on sampling positions.
        self.base_model = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.num_blocks = self._determine_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
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
        sampled: list[list[int]] = [[] for _ in req_ids]
        # No forward for an empty batch: a DP rank then runs a dummy batch, which with expert
        # parallelism joins the peers' collectives in its place (minicore/dp/engine.py).
        if req_ids:
            meta = AttentionMetadata.build([s.block_ids for s in states], computed, num_new,
                                           self.kv_caches)
            hidden = self._forward(input_ids, meta)
            if sampling_rows:
                last_token = [meta.query_start_loc_cpu[row + 1] - 1 for row in sampling_rows]
                logits = compute_logits(self.model.config, self.lm_head(hidden[last_token]))
                tokens = sample(logits, self._sampling_metadata([states[r] for r in sampling_rows]))
                for row, token in zip(sampling_rows, tokens.tolist()):
                    states[row].token_ids.append(token)
                    sampled[row] = [token]
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

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
        top_k = top_p = None
        if not all_greedy and any(p.top_k > 0 for p in params):
            # A top_k past the vocabulary keeps every token (and may not fit a tensor).
            top_k = torch.tensor([min(p.top_k, self.vocab_size) for p in params],
                                 device=self.device)
        if not all_greedy and any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=self.device)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        # A stop id past the vocabulary can never be sampled: nothing to mask (nor to index).
        blocked = {i: ids for i, s in enumerate(states)
                   if (ids := [t for t in s.min_tokens_blocked_ids() if t < self.vocab_size])}
        return SamplingMetadata(temperature, top_k, top_p, generators, all_greedy, blocked)

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
