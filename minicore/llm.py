"""LLM: offline batched generation on an in-process EngineCore.

Mirrors vllm/entrypoints/llm.py (LLM.generate, LLM.chat, get_default_sampling_params) and the
prompt parsing of vllm/renderers/inputs/preprocess.py (prompt_to_seq, parse_dec_only_prompt).
Requests are built by the same InputProcessor and read back by the same OutputProcessor as the
server's (minicore/engine/); chat formats conversations with the server's chat_utils.
SamplingParams.n fans a prompt out into n engine requests (the j-th seeded with seed + j) whose
outputs come back as one RequestOutput with n CompletionOutputs, as vLLM's ParentRequest does.
The control plane (sleep / wake_up, pause_generation / resume_generation, collective_rpc, the
weight update) calls the engine's utility methods (minicore/engine/control.py) in this process.
Left out: beam search, pooling, LoRA, multimodal and embeds prompts, and data
parallelism (one engine in this process; DP runs through `python -m minicore serve
--data-parallel-size N` or AsyncLLM).
"""

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

import msgspec
from tqdm.auto import tqdm

from minicore.arg_utils import resolve_chat_template
from minicore.config import create_engine_config
from minicore.engine.components import make_engine_core
from minicore.engine.control import PauseMode
from minicore.engine.input_processor import InputProcessor
from minicore.engine.launch import log_engine_config, resolve_max_model_len, resolve_model
from minicore.engine.output_processor import OutputProcessor
from minicore.entrypoints.chat_utils import apply_hf_chat_template, parse_chat_messages
from minicore.logger import configure_logging
from minicore.outputs import RequestOutput
from minicore.protocol import EngineCoreRequest
from minicore.request import Request
from minicore.sampling_params import SamplingParams, parallel_sample_params
from minicore.tracing.otel import make_request_tracer

# The keys of vLLM's TextPrompt / TokensPrompt dicts that minicore implements.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_to_seq(prompts) -> list:
    """One prompt or a sequence of them, as a list of prompts (vLLM's prompt_to_seq: a string, a
    dict or a list of ints is one prompt)."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(type(t) is int for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, a dict with 'prompt' "
                         f"or 'prompt_token_ids', or a list of these; got {type(prompts).__name__}")
    return list(prompts)


def parse_prompt(prompt, index: int) -> tuple[str | list[int], str | None]:
    """(what the InputProcessor takes: text or token ids, the prompt's text if any) for one of
    vLLM's decoder-only prompt forms: str, list[int], {"prompt": str},
    {"prompt_token_ids": list[int]}."""
    where = f"prompt {index}"
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, list):
        if not prompt or not all(type(t) is int for t in prompt):
            raise ValueError(f"{where}: a token prompt must be a non-empty list of integers")
        return prompt, None
    if isinstance(prompt, dict):
        unknown = sorted(map(str, set(prompt) - set(_PROMPT_KEYS)))
        if unknown:
            raise ValueError(f"{where}: unsupported prompt key(s) {', '.join(unknown)}; minicore "
                             f"takes {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}")
        if "prompt_token_ids" in prompt:
            # vLLM's TokensPrompt may carry the text too; the ids are what runs.
            return parse_prompt(prompt["prompt_token_ids"], index)[0], prompt.get("prompt")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"{where}: 'prompt' must be a string, got "
                                 f"{type(prompt['prompt']).__name__}")
            return prompt["prompt"], prompt["prompt"]
        raise ValueError(f"{where}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    raise ValueError(f"{where}: expected a string, a list of token ids or a dict, got "
                     f"{type(prompt).__name__}")


def _per_prompt(value, num_prompts: int, what: str) -> list:
    """A value given once for every prompt, or as a list of one per prompt (vLLM's rule for
    sampling_params and priority)."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"got {len(value)} {what} for {num_prompts} prompts")
    return list(value)


@dataclasses.dataclass(slots=True)
class _Parent:
    """One prompt's n engine requests, by sample index."""
    request_id: str
    children: list[EngineCoreRequest]
    text: str | None


class LLM:
    """LLM(model=None, **engine_args): model is a safetensors directory, a .gguf file, None for the
    default SmolLM2-135M-Instruct, or an already loaded transformers model (then pass tokenizer=).
    engine_args are EngineConfig fields by vLLM's names (max_num_seqs, max_model_len, block_size,
    kv_cache_memory, enable_prefix_caching, scheduling_policy, dtype, async_scheduling, ...), and
    vLLM's speculative_config: a dict as --speculative-config's JSON, or a SpeculativeConfig."""

    def __init__(self, model=None, tokenizer=None, **engine_args):
        if isinstance(tokenizer, str):  # vLLM's LLM(tokenizer=PATH): a directory, not an object
            engine_args["tokenizer"], tokenizer = tokenizer, None
        configure_logging("MainProcess")  # as vLLM's import does; an app's own setup is kept
        loaded = model is not None and not isinstance(model, str)
        if loaded and tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: LLM(model, tokenizer=...)")
        config = create_engine_config(model=None if loaded else model, **engine_args)
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("LLM runs one in-process engine: data_parallel_size must be 1 (serve "
                             "with --data-parallel-size N, or use AsyncLLM, for DP)")
        # max_model_len auto (-1) becomes the model's context length here, as in serve.
        self.config = (resolve_max_model_len(config, model.config.to_dict(),
                                             {"model_max_length": tokenizer.model_max_length})
                       if loaded else resolve_model(config))
        self.llm_engine = make_engine_core(self.config, model if loaded else None, tokenizer)
        runner = self.llm_engine.model_runner
        log_engine_config(self.config, runner)
        self.tokenizer = runner.tokenizer
        self.input_processor = InputProcessor(self.config, self.tokenizer,
                                              runner.model.config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, make_request_tracer(
            self.config.observability_config.otlp_traces_endpoint))
        self._request_counter = itertools.count()
        self.default_sampling_params: dict | None = None

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's generation_config.json sampling defaults with --generation-config
        auto, SamplingParams() with vllm."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.config.model_config.get_diff_sampling_param()
        return SamplingParams(**self.default_sampling_params)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool | Callable[..., tqdm] = True,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for each prompt, results in prompt order. A prompt is a string, a list of token
        ids, {"prompt": str} or {"prompt_token_ids": [...]}; prompts: one, or a list of them
        (mixed forms allowed). Text prompts are tokenized with the special tokens (BOS) the
        tokenizer adds, as vLLM."""
        parsed = [parse_prompt(p, i) for i, p in enumerate(prompt_to_seq(prompts))]
        return self._generate(parsed, sampling_params, use_tqdm, priority, True)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True,
             priority: int | Sequence[int] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...]; content a
        string or OpenAI text parts), formatted with chat_template (a template or its file), else
        --chat-template's, else the tokenizer's, which sees tools (OpenAI tool definitions) as
        vLLM's does. The template holds the special tokens, so the text is tokenized without
        adding any (vLLM's rule)."""
        conversations = (
            [messages] if isinstance(messages, list) and messages
            and all(isinstance(m, dict) for m in messages) else messages)
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError("messages must be a conversation (a non-empty list of message "
                             "dicts) or a list of conversations")
        template = resolve_chat_template(chat_template if chat_template is not None
                                         else self.config.model_config.chat_template)
        texts = [apply_hf_chat_template(
            self.tokenizer, parse_chat_messages(c), chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, tools=tools) for c in conversations]
        return self._generate([(t, t) for t in texts], sampling_params, use_tqdm, priority, False)

    def _generate(self, parsed: list[tuple[str | list[int], str | None]], sampling_params,
                  use_tqdm, priority, add_special_tokens: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(parsed), "sampling params")
        priorities = _per_prompt(priority or 0, len(parsed), "priorities")
        # Build and check every request before adding any, so a bad one leaves nothing behind.
        parents = []
        for (prompt, text), p, prio in zip(parsed, params, priorities):
            request_id = str(next(self._request_counter))
            request = self.input_processor.process_inputs(
                request_id, prompt, p, priority=prio, add_special_tokens=add_special_tokens)
            children = [request] if p.n == 1 else [
                msgspec.structs.replace(request, request_id=f"{request_id}_{j}",
                                        sampling_params=parallel_sample_params(p, j))
                for j in range(p.n)]
            parents.append(_Parent(request_id, children, text))
        return self._run(parents, use_tqdm)

    def _run(self, parents: list[_Parent], use_tqdm) -> list[RequestOutput]:
        engine, processor = self.llm_engine, self.output_processor
        if engine.is_scheduler_paused():
            state = "asleep: call wake_up()" if engine.sleeping_tags else (
                "paused: call resume_generation()")
            raise RuntimeError(f"the engine is {state} first, or nothing would be generated")
        requests = [child for parent in parents for child in parent.children]
        for parent in parents:
            for child in parent.children:
                processor.add_request(child, parent.text)
                engine.add_request(Request.from_engine_core_request(child))
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(requests), desc="Processed prompts",
                       disable=not use_tqdm, dynamic_ncols=True)
        finished: dict[str, RequestOutput] = {}
        start, num_in, num_out = time.perf_counter(), 0, 0
        try:
            while processor.has_unfinished_requests():
                outputs, _ = engine.step_fn()
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
        return [_merge(parent, finished) for parent in parents]


    # ---- the control plane (vLLM's LLM.sleep, wake_up, collective_rpc, reset_prefix_cache) ----

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Release memory until wake_up: the KV cache (level 1), and the weights (level 2, reloaded
        from the model directory on wake-up); level 0 only pauses (the "scheduling" tag)."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back "weights", "kv_cache" and/or "scheduling" (None: all); generation resumes
        once all the memory is. Whether it has (vLLM's fully_awake)."""
        self.llm_engine.wake_up(tags)
        return not self.is_sleeping()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def release_kv_cache_memory(self) -> None:
        """Free the KV cache's memory after sleep(level=0) (or pause_generation) with nothing
        kept; wake_up(["kv_cache"]) brings it back."""
        self.llm_engine.release_kv_cache_memory()

    def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Hold the scheduler (generate raises until resume_generation). Between generate calls
        nothing is in flight, so the modes differ only for an engine driven step by step."""
        self.llm_engine.pause_scheduler(mode, clear_cache)

    def resume_generation(self) -> None:
        self.llm_engine.resume_scheduler()

    def is_paused(self) -> bool:
        return self.llm_engine.is_scheduler_paused()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None) -> list:
        """Run method on every worker (here one, the model runner): a name of its public methods
        (load_weights(path), ...) or a function called with the runner first; one result each."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def start_weight_update(self) -> None:
        self.llm_engine.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        """Load weights in place from update_info["path"] (a safetensors file or directory)."""
        self.llm_engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm_engine.finish_weight_update(weight_version)

    def get_weight_version(self) -> str:
        return self.llm_engine.get_weight_version()


def _merge(parent: _Parent, finished: dict[str, RequestOutput]) -> RequestOutput:
    """A prompt's RequestOutput: its n samples' completions, by index, under the prompt's id (the
    first sample's prompt fields and metrics)."""
    outputs = [finished[child.request_id] for child in parent.children]
    completions = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        completion.index = index
        completions.append(completion)
    return dataclasses.replace(outputs[0], request_id=parent.request_id, outputs=completions)
