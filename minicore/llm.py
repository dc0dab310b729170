"""LLM: offline batched generation on an in-process EngineCore.

Mirrors vllm/entrypoints/llm.py (LLM.generate, LLM.chat) with the output side of
vllm/v1/engine/output_processor.py (detokenizing, stop strings). Left out: beam search, pooling,
LoRA, multimodal prompts, n > 1, logprobs, and data parallelism (one engine in this process; DP
runs through `python -m minicore serve --data-parallel-size N` or AsyncEngineClient).
"""

import itertools
import time

from tqdm.auto import tqdm

from minicore.config import create_engine_config
from minicore.engine.core import EngineCore
from minicore.engine.output_processor import RequestState
from minicore.outputs import RequestOutput
from minicore.request import Request
from minicore.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """LLM(model=None, **engine_args): model is a safetensors directory, a .gguf file, None for the
    default SmolLM2-135M-Instruct, or an already loaded transformers model (then pass tokenizer=).
    engine_args are EngineConfig fields by vLLM's names (max_num_seqs, max_model_len, block_size,
    kv_cache_memory, enable_prefix_caching, scheduling_policy, dtype, ...)."""

    def __init__(self, model=None, tokenizer=None, **engine_args):
        loaded = model is not None and not isinstance(model, str)
        if loaded and tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: LLM(model, tokenizer=...)")
        self.config = create_engine_config(model=None if loaded else model, **engine_args)
        if self.config.parallel_config.data_parallel_size > 1:
            raise ValueError("LLM runs one in-process engine: data_parallel_size must be 1 (serve "
                             "with --data-parallel-size N, or use AsyncEngineClient, for DP)")
        self.llm_engine = EngineCore(self.config, model if loaded else None, tokenizer)
        self.tokenizer = self.llm_engine.model_runner.tokenizer
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # Build and check every request before adding any, so a bad one leaves nothing behind.
        requests = [self._make_request(prompt, p) for prompt, p in zip(prompts, params)]
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...]), formatted with
        the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> tuple[Request, RequestState]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, token_ids = None, list(prompt)
        max_model_len = self.config.scheduler_config.max_model_len
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if len(token_ids) > max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"({max_model_len})")
        vocab_size = self.llm_engine.model_runner.model.config.vocab_size
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        request_id = str(next(self._request_counter))
        request = Request(request_id, token_ids, params, eos_token_id=self.tokenizer.eos_token_id)
        return request, RequestState(request_id, text, token_ids, params, self.tokenizer)

    def _run(self, requests: list[tuple[Request, RequestState]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        states = {request.request_id: state for request, state in requests}
        for request, _ in requests:
            engine.add_request(request)
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        start, num_in, num_out = time.perf_counter(), 0, 0
        try:
            unfinished = set(states)
            while unfinished:
                outputs, _ = engine.step()
                for output in outputs:
                    state = states[output.request_id]
                    num_out += len(output.new_token_ids)
                    if state.process(output):
                        engine.abort_requests([output.request_id])
                    if state.finished:
                        unfinished.discard(output.request_id)
                        num_in += len(state.prompt_token_ids)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                                            f"output: {num_out / elapsed:.2f} toks/s", refresh=False)
        finally:
            bar.close()
            # On an interrupt or error, leave nothing running in the engine.
            engine.abort_requests([r for r in states if r in engine.scheduler.requests])
        return [state.make_request_output() for state in states.values()]
