"""LLM: offline batched generation on an in-process EngineCore.

Mirrors vllm/entrypoints/llm.py (LLM.generate, LLM.chat). Requests are built by the same
InputProcessor and read back by the same OutputProcessor as the server's (minicore/engine/).
Left out: beam search, pooling, LoRA, multimodal prompts, n > 1, logprobs, and data parallelism
(one engine in this process; DP runs through `python -m minicore serve --data-parallel-size N` or
AsyncLLM).
"""

import itertools
import time

from tqdm.auto import tqdm

from minicore.config import create_engine_config
from minicore.engine.core import EngineCore
from minicore.engine.input_processor import InputProcessor, Prompt
from minicore.engine.output_processor import OutputProcessor
from minicore.outputs import RequestOutput
from minicore.arg_utils import resolve_chat_template
from minicore.protocol import EngineCoreRequest
from minicore.request import Request
from minicore.sampling_params import SamplingParams


class LLM:
    """LLM(model=None, **engine_args): model is a safetensors directory, a .gguf file, None for the
    default SmolLM2-135M-Instruct, or an already loaded transformers model (then pass tokenizer=).
    engine_args are EngineConfig fields by vLLM's names (max_num_seqs, max_model_len, block_size,
    kv_cache_memory, enable_prefix_caching, scheduling_policy, dtype, ...)."""

    def __init__(self, model=None, tokenizer=None, **engine_args):
        if isinstance(tokenizer, str):  # vLLM's LLM(tokenizer=PATH): a directory, not an object
            engine_args["tokenizer"], tokenizer = tokenizer, None
        loaded = model is not None and not isinstance(model, str)
        if loaded and tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: LLM(model, tokenizer=...)")
        self.config = create_engine_config(model=None if loaded else model, **engine_args)
        if self.config.parallel_config.data_parallel_size > 1:
            raise ValueError("LLM runs one in-process engine: data_parallel_size must be 1 (serve "
                             "with --data-parallel-size N, or use AsyncLLM, for DP)")
        self.llm_engine = EngineCore(self.config, model if loaded else None, tokenizer)
        runner = self.llm_engine.model_runner
        self.tokenizer = runner.tokenizer
        self.input_processor = InputProcessor(self.config, self.tokenizer,
                                              runner.model.config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
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
        requests = [self.input_processor.process_inputs(str(next(self._request_counter)), prompt, p)
                    for prompt, p in zip(prompts, params)]
        texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        return self._run(requests, texts, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...]), formatted with
        the chat template (chat_template's, else the tokenizer's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = resolve_chat_template(self.config.model_config.chat_template)
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, chat_template=template,
                                                      add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests: list[EngineCoreRequest], texts: list[str | None],
             use_tqdm: bool) -> list[RequestOutput]:
        engine, processor = self.llm_engine, self.output_processor
        for request, text in zip(requests, texts):
            processor.add_request(request, text)
            engine.add_request(Request.from_engine_core_request(request))
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        finished: dict[str, RequestOutput] = {}
        start, num_in, num_out = time.perf_counter(), 0, 0
        try:
            while processor.has_unfinished_requests():
                outputs, _ = engine.step()
                num_out += sum(len(output.new_token_ids) for output in outputs)
                processed = processor.process_outputs(outputs)
                if processed.reqs_to_abort:  # stop strings ended them here
                    engine.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    finished[output.request_id] = output
                    num_in += len(output.prompt_token_ids)
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                                        f"output: {num_out / elapsed:.2f} toks/s", refresh=False)
        finally:
            bar.close()
            # On an interrupt or error, leave nothing running, here or in the engine.
            unfinished = [r.request_id for r in requests if r.request_id not in finished]
            processor.abort_requests(unfinished)
            engine.abort_requests(unfinished)
        return [finished[r.request_id] for r in requests]
