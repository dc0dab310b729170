"""ModelRunner: owns the model and its paged KV cache; turns a SchedulerOutput into sampled tokens.

Mirrors vllm/v1/worker/gpu_model_runner.py (with gpu_worker.py's KV cache sizing): it keeps each
request's token ids and block table across steps, packs the step's tokens into one batch
(input_ids [1, T]), runs the transformers model with minicore's paged attention, computes logits
only at the positions that sample (and, for requests that ask for prompt logprobs, at their prompt
positions), and samples with minicore/model/sampler.py. The sampling metadata is rebuilt each step
from the request states (SamplingMetadata.from_states; vLLM keeps it in its persistent InputBatch).
What is optional is chosen once, in __init__: how decode attention reads keys (on CPU per-request
rows, minicore/model/decode_kv.py; else attention.py's gather), the CPU linear layers, both
for every row and every token with batch invariance (the CPU's default; docs/ARCHITECTURE.md),
and the CPU norms and rotary embedding (minicore/model/cpu_layers.py), and on CPU a Llama model's
layers as plain calls (minicore/model/llama_forward.py); the logprobs a request asks for come
from a component (minicore/model/logprobs.py) that knows which requests asked; with speculative
decoding, the sampling step verifies each request's drafts (minicore/model/rejection_sampler.py),
which the state update appends to its token ids as vLLM writes them into its input batch, so that
packing and the sampling test take them as they are.
DeepSeek-V2/V3's attention modules run multi-head latent attention over a cache of latent rows
(minicore/model/mla.py; its layout: minicore/model/kv_cache_interface.py).
Sleep mode and in-place weight loading are minicore/model/sleep_mode.py's. Left out: CUDA graphs,
persistent input batches, pipeline/tensor parallelism.
"""

import logging
from functools import partial

import torch

from minicore.config import EngineConfig
from minicore.dp.weight_transfer import join_as_engine
from minicore.model import sleep_mode
from minicore.model.async_spec_decode import AsyncSpecDecodeSampler, RequestDrafts
from minicore.model.attention import (
    AttentionMetadata,
    GatheredDecode,
    compute_logits,
    use_paged_attention,
)
from minicore.model.cpu_layers import use_cpu_layers
from minicore.model.cpu_linear import use_cpu_linear
from minicore.model.cpu_memory import keep_freed_memory
from minicore.model.decode_kv import DecodeKVBuffers
from minicore.model.eagle import EagleProposer
from minicore.model.kv_cache_interface import kv_cache_spec
from minicore.model.llama_forward import llama_forward
from minicore.model.logprobs import LogprobsOutput
from minicore.model.mla import use_latent_attention
from minicore.model.native import native_kernels, resolve_batch_invariant
from minicore.model.rejection_sampler import SpecDecodeSampler
from minicore.model.runner_base import NO_RUNNER_DRAFTER, CachedRequestState, ModelRunnerBase
from minicore.model.sampler import (
    SamplingMetadata,
    apply_grammar_bitmask,
    sample,
    take_grammar_rows,
)
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput
from minicore.spec_decode.drafter import make_drafter

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
        # Batch invariance (on CPU by default): every linear layer by the native kernel and
        # every token a decode query of it, each summing in one order whatever the batch.
        self.batch_invariant = resolve_batch_invariant(config.model_config, self.device,
                                                       native_kernels())
        self.build_metadata = partial(AttentionMetadata.build,
                                      token_queries=self.batch_invariant)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.bind_layers(model)
        # The base model gives hidden states; the head runs only on sampling positions. On CPU
        # a Llama model's layers run as plain calls (llama_forward.py), else through transformers.
        self.base_model = model.base_model
        plain = (llama_forward(self.base_model, native_kernels()) if self.device.type == "cpu"
                 else None)
        self.forward_hidden = plain or self._transformers_forward
        self.lm_head = model.get_output_embeddings()
        self.logprobs = LogprobsOutput(self.vocab_size, self._logits)
        self.sample_step, self.take_sampling_inputs, self.drafter = self._make_sample_step(config)
        # A KV cache per layer, the drafter's own layers' too (the MTP layers: eagle.py).
        self.num_kv_layers = model.config.num_hidden_layers + self.drafter.num_layers
        self.num_blocks = self._determine_num_blocks()
        # A future of the trainer's weight transfer group (minicore/dp/weight_transfer.py).
        self.weight_transfer = None
        self.init_kv_cache()
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", self.num_blocks,
                    self.block_size, (self.num_blocks - 1) * self.block_size)

    def init_kv_cache(self) -> None:
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        # Chosen once: on CPU decode attention reads per-request rows instead of gathering
        # blocks (decode_kv.py), with the native kernel where it builds; elsewhere the gather.
        self.decode_attention = (
            DecodeKVBuffers(self.kv_caches, kernel=native_kernels(),
                            token_queries=self.batch_invariant)
            if self.device.type == "cpu" else GatheredDecode())

    def bind_layers(self, module: torch.nn.Module) -> None:
        """The model's layers, or a drafter's (eagle.py), bound to minicore's kernels:
        DeepSeek's attention over its latent cache (mla.py; none for other models), and on CPU
        the linear layers, norms and rotary embeddings."""
        use_latent_attention(module, native_kernels() if self.batch_invariant else None)
        if self.device.type == "cpu":
            use_cpu_linear(module, native_kernels(), self.batch_invariant)
            use_cpu_layers(module, native_kernels())

    def bind_weights(self) -> None:
        """After the weights' tensors changed: the layers bound to kernels take them anew."""
        self.bind_layers(self.model)

    # ---- sleep mode and weights (sleep_mode.py; collective_rpc may name load_weights) ----------

    def check_can_sleep(self, level: int) -> None:
        sleep_mode.check_can_sleep(self, level)

    def sleep(self, level: int) -> None:
        sleep_mode.release(self, level)

    def wake_up(self, tags: list[str], level: int) -> None:
        sleep_mode.restore(self, tags, level)

    def load_weights(self, path: str) -> int:
        return sleep_mode.load_weights(self, path)

    def update_weights(self, update_info: dict) -> int:
        return sleep_mode.update_weights(self, update_info)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Start joining the trainer's group as rank rank_offset + this engine's DP rank (on a
        thread of its own: weight_transfer.join_as_engine)."""
        self.weight_transfer = join_as_engine(
            init_info, self.config.parallel_config.data_parallel_rank, self.device)

    def shutdown_weight_transfer_engine(self) -> None:
        self.weight_transfer = None

    def compute_weight_checksums(self) -> dict[str, str]:
        return sleep_mode.weight_checksums(self)

    def reset_weights(self) -> None:
        sleep_mode.reset_weights(self)

    # ---- KV cache sizing -----------------------------------------------------------------------

    def _bytes_per_block(self) -> int:
        dtype_size = torch.tensor([], dtype=self.model.dtype).element_size()
        spec = kv_cache_spec(self.model.config)
        return self.num_kv_layers * self.block_size * spec.bytes_per_token(dtype_size)

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
        kv_caches = self._allocate_kv_cache(1 + -(-num_tokens // self.block_size))
        self._forward_dummy(num_tokens, kv_caches)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * self.config.cache_config.gpu_memory_utilization) - peak)

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        shape = kv_cache_spec(self.model.config).shape(num_blocks, self.block_size)
        return [torch.zeros(shape, dtype=self.model.dtype, device=self.device)
                for _ in range(self.num_kv_layers)]

    # ---- one step ------------------------------------------------------------------------------

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(self.device).manual_seed(seed)

    def _make_sample_step(self, config: EngineConfig):
        """Chosen once: the sampling step, what it takes from each SchedulerOutput before the
        forward, and the drafter that proposes after it (vLLM's GPUModelRunner.drafter). One
        token per sampling row, masked by its grammar row (sampler.py); or, with speculative
        decoding, each row's drafts verified and its accepted ones plus one token
        (rejection_sampler.py). The runner proposes with the checkpoint's MTP layers (eagle.py),
        and with async scheduling whatever the method (async_spec_decode.py); else the engine
        does."""
        if (spec := config.speculative_config) is None:
            return (self._sample, partial(take_grammar_rows, requests=self.requests),
                    NO_RUNNER_DRAFTER)
        args = self.vocab_size, self.device, self._logits, self.logprobs
        proposer = EagleProposer(self) if spec.use_eagle() else None
        if config.scheduler_config.async_scheduling:
            sampler = drafter = AsyncSpecDecodeSampler(
                *args, proposer=proposer or RequestDrafts(make_drafter(config)),
                disable_by_batch_size=spec.disable_by_batch_size)
        else:
            sampler, drafter = SpecDecodeSampler(*args), proposer or NO_RUNNER_DRAFTER
        return sampler, partial(sampler.take_drafts, requests=self.requests), drafter

    def _update_states(self, so: SchedulerOutput) -> None:
        super()._update_states(so)
        self.logprobs.update_states(so)
        self.take_sampling_inputs(so)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        input_ids, computed, num_new, sampling_rows = [], [], [], []
        for row, (state, n) in enumerate(zip(states, so.num_scheduled_tokens.values())):
            start = state.num_computed_tokens
            # Fewer than scheduled only where drafts proposed here fell short of placeholders.
            n = min(n, len(state.token_ids) - start)
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
            decode_attention = self.decode_attention.plan(req_ids, computed, num_new,
                                                          self.requests)
            meta = self.build_metadata([s.block_ids for s in states], computed, num_new,
                                       self.kv_caches, decode_attention)
            hidden = self._forward(input_ids, meta)
            if sampling_rows:
                self.sample_step(hidden, meta.query_start_loc_cpu, states, sampling_rows, output)
            self.drafter.propose_draft_token_ids(hidden, meta, states, output)
            self.logprobs.add_prompt(hidden, meta.query_start_loc_cpu, states, computed, num_new,
                                     output)
        return output

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts the runner proposed in its last step, per request (vLLM's): with sync
        scheduling, the MTP layers' (eagle.py), for the engine's MTPDrafter."""
        return self.drafter.take_draft_token_ids()

    def _sample(self, hidden: torch.Tensor, query_start_loc: list[int],
                states: list[CachedRequestState], rows: list[int],
                output: ModelRunnerOutput) -> None:
        """Sample the rows whose last position is their newest token; fill output's sampled
        tokens and, for rows that asked, their logprobs."""
        logits = self._logits(hidden[[query_start_loc[row + 1] - 1 for row in rows]])
        sampling_states = [states[row] for row in rows]
        apply_grammar_bitmask(logits, sampling_states)
        metadata = SamplingMetadata.from_states(sampling_states, self.vocab_size, self.device)
        result = sample(logits, metadata)
        for row, token in zip(rows, result.sampled.tolist()):
            states[row].token_ids.append(token)
            output.sampled_token_ids[row] = [token]
        self.logprobs.add_sampled(result.logprobs, rows, output)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states, finished as the model's head does (compute_logits)."""
        return compute_logits(self.model.config, self.lm_head(hidden))

    @torch.inference_mode()
    def _forward(self, input_ids: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of one packed batch."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        return self.forward_hidden(ids, meta.positions.unsqueeze(0), meta)

    def _transformers_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                              meta: AttentionMetadata) -> torch.Tensor:
        out = self.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              minicore_meta=meta)
        return out.last_hidden_state[0]

    def _forward_dummy(self, num_tokens: int, kv_caches: list[torch.Tensor]) -> None:
        """A forward of num_tokens tokens of one sequence, writing only into kv_caches."""
        num_blocks = -(-num_tokens // self.block_size)
        meta = AttentionMetadata.build([list(range(1, num_blocks + 1))], [0], [num_tokens],
                                       kv_caches)
        self._forward([0] * num_tokens, meta)

    def execute_dummy_batch(self) -> None:
        """One token through the model, its KV written to the null block (block 0), which no
        request uses: lets a DP rank with nothing to do join its peers' collectives."""
        meta = AttentionMetadata.build([[0]], [0], [1], self.kv_caches)
        self._forward([0], meta)
