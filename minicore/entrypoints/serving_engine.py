"""The OpenAI endpoints' shared machinery: checks, engine requests, choices and their merge.

Mirrors vllm/entrypoints/openai/serving_engine.py (model check, input validation, error
responses) on top of AsyncLLM: its InputProcessor builds (and checks) every engine request, and
AsyncLLM.generate runs each. Everything a request could be refused for is checked before the first
engine request is sent, so a refused request leaves nothing behind, and a streamed one never turns
into an error after its 200. Each choice (n per prompt, for every prompt of a completion request)
is its own engine request; their outputs are merged as they arrive. A choice whose engine request
ends early (client gone, server shutting down) is aborted in the engine and finishes as "abort".
Chat prompts are rendered by chat_utils (vLLM's chat_utils); unset sampling fields take the
generation config's defaults (ModelConfig.get_diff_sampling_param). A request's own chat_template
needs --trust-request-chat-template, as in vLLM. Text prompts are tokenized on one thread of
their own (vLLM's tokenizer executor), off the event loop. The endpoints themselves are in
serving.py. A structured outputs constraint the InputProcessor refuses (a bad schema, regex or
grammar) is a 400 naming the field the client gave it in (response_format or structured_outputs).
Left out: beam search, multimodal content.
"""

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec

from minicore.arg_utils import resolve_chat_template
from minicore.config import rank_span
from minicore.engine.async_llm import AsyncLLM
from minicore.engine.core_client import EngineDeadError
from minicore.engine.input_processor import InvalidRequestError
from minicore.entrypoints.chat_utils import apply_hf_chat_template, parse_chat_messages
from minicore.entrypoints.openai_protocol import (
    ChatTemplateFields,
    ModelCard,
    ModelList,
    OpenAIError,
    PromptTokenUsageInfo,
    SamplingRequest,
    UsageInfo,
    check_text_param,
    make_error,
    sse,
)
from minicore.outputs import Logprob, RequestOutput
from minicore.protocol import EngineCoreRequest
from minicore.sampling_params import SamplingParams, parallel_sample_params

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class Prompt:
    text: str
    token_ids: list[int]
    # Given as text, not token ids (the engine's detokenizer then starts from the text).
    given_as_text: bool = True


@dataclass(slots=True)
class Choice:
    """One choice of a response: one engine request and what has been sent of it."""
    index: int
    request_id: str
    prompt: Prompt
    # AsyncLLM.generate's stream; closing it early aborts the request.
    outputs: AsyncGenerator[RequestOutput, None]
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The KV connector's params from the engine's final output (disaggregated prefill).
    kv_transfer_params: dict | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    token_ids: list[int] = field(default_factory=list)
    # Cumulative, as the engine's outputs: one dict per generated token (when asked for).
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Streaming: generated tokens whose logprobs were sent, the next text offset, echo done.
    num_logprobs_sent: int = 0
    text_offset: int = 0
    echoed: bool = False


class OpenAIServingBase:
    def __init__(self, client: AsyncLLM, model_names: list[str],
                 enable_prompt_tokens_details: bool = False,
                 trust_request_chat_template: bool = False,
                 return_tokens_as_token_ids: bool = False):
        self.client = client
        self.model_names = model_names
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.trust_request_chat_template = trust_request_chat_template
        # The default of the request field of that name (vLLM's --return-tokens-as-token-ids).
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.tokenizer = client.tokenizer
        model_config = client.config.model_config
        self.chat_template = resolve_chat_template(model_config.chat_template)
        self.default_sampling_params = model_config.get_diff_sampling_param()
        if self.default_sampling_params:
            logger.info("default sampling parameters from the generation config (%s): %s; "
                        "--generation-config vllm leaves them out",
                        model_config.generation_config, self.default_sampling_params)
        self.vocab_size = client.vocab_size
        self.max_model_len = client.config.scheduler_config.max_model_len
        self.created = int(time.time())
        # Choices with an engine request in flight, by request id.
        self.running: dict[str, Choice] = {}
        self.shutting_down = False
        # Cleanup tasks run detached from the request (it may be cancelled); referenced until done.
        self._cleanups: set[asyncio.Task] = set()
        # Prompts are tokenized on a thread of their own (vLLM's _tokenizer_executor), so that a
        # long one does not stall the event loop, and every other client, meanwhile. One thread:
        # an encode may reset the tokenizer's truncation settings, which another encode running
        # at the same time would trip over.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    # ----------------------------------------------------------------------------- checks

    def check_model(self, model: str | None) -> None:
        if model is None:
            return
        check_text_param("model", model)
        if model not in self.model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def _check_serving(self) -> None:
        if self.shutting_down:
            raise OpenAIError("the server is shutting down", 503)
        if self.client.errored:
            raise OpenAIError("the engine process is dead; the server cannot serve requests", 503)

    def _check_request(self, request: SamplingRequest) -> None:
        self._check_serving()
        self.check_model(request.model)
        request.check_unsupported()
        if ignored := request.ignored_fields():
            logger.warning("ignoring unknown request fields: %s", ", ".join(ignored))

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams, unset fields from the generation config; a max_tokens
        left unset takes its max_tokens (max_new_tokens), as vLLM's get_max_tokens."""
        if max_tokens is None:
            max_tokens = self.default_sampling_params.get("max_tokens")
        return request.to_sampling_params(max_tokens, self.default_sampling_params)

    async def tokenize(self, prompt: str | list[int], add_special_tokens: bool,
                       param: str) -> list[int]:
        """A prompt's token ids: text encoded on the tokenizer thread, ids as they are."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await self.on_tokenizer_thread(self.encode, prompt, add_special_tokens, param)

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """A text's token ids (BOS as add_special_tokens says, vLLM's default True for a prompt,
        False for chat); a 400 naming param for text that is not valid Unicode. It takes as long
        as the text is: call it on the tokenizer thread."""
        check_text_param(param, text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def on_tokenizer_thread(self, fn, *args):
        """fn(*args), run on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def _process_inputs(self, request_id: str, prompt: str | list[int],
                              params: SamplingParams, request: SamplingRequest, rank: int | None,
                              param: str) -> EngineCoreRequest:
        """The engine request for one prompt; param names the prompt's field in errors. The
        context length is checked first, and max_tokens clamped to it (_check_context_length)."""
        token_ids = await self.tokenize(prompt, request.add_special_tokens, param)
        self._check_context_length(len(token_ids), params, param, request.field_of("max_tokens"))
        try:
            return self.client.input_processor.process_inputs(
                request_id, token_ids, params, priority=request.priority, data_parallel_rank=rank)
        except InvalidRequestError as e:
            name = param if e.param == "prompt" else request.field_of(e.param or "")
            raise OpenAIError(str(e), 400, name) from None

    def _check_context_length(self, num: int, params: SamplingParams, param: str,
                              max_tokens_param: str) -> None:
        """vLLM's rule (get_max_tokens): the prompt must leave room for a token, max_tokens may
        not exceed the context alone, and it is clamped to the room the prompt leaves (the
        prompt as truncate_prompt_tokens leaves it)."""
        if (limit := params.truncate_prompt_tokens) is not None:
            num = min(num, self.max_model_len if limit == -1 else limit)
        if num >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {num} input tokens. Please reduce the length of the input.",
                400, param)
        if params.max_tokens is None:
            return
        if params.max_tokens > self.max_model_len:
            raise OpenAIError(
                f"{max_tokens_param} is too large: {params.max_tokens}. This model's maximum "
                f"context length is {self.max_model_len} tokens.", 400, max_tokens_param)
        params.max_tokens = min(params.max_tokens, self.max_model_len - num)

    def _data_parallel_rank(self, header: str | None) -> int | None:
        if header is None:
            return None
        ranks = self.client.config.parallel_config.engine_ranks
        try:
            rank = int(header)
        except ValueError:
            rank = -1
        if rank not in ranks:
            raise OpenAIError(f"X-data-parallel-rank must be an engine rank in {rank_span(ranks)}, "
                              f"got {header!r}", 400, "X-data-parallel-rank")
        return rank

    # ----------------------------------------------------------------------------- prompts

    def render_chat(self, request: ChatTemplateFields,
                    tools: list[dict] | None = None) -> tuple[list[dict], str]:
        """The parsed conversation and the prompt text its chat template makes, with the
        request's tools (checked: tool_calls.check_tools)."""
        template = self.chat_template
        if request.chat_template is not None or (request.chat_template_kwargs or {}).get(
                "chat_template") is not None:
            if not self.trust_request_chat_template:
                raise OpenAIError("Chat template is passed with request, but "
                                  "--trust-request-chat-template is not set. Refused request "
                                  "with untrusted chat template.", 400, "chat_template")
            template = request.chat_template
        try:
            conversation = parse_chat_messages([m.model_dump() for m in request.messages])
            return conversation, apply_hf_chat_template(
                self.tokenizer, conversation, chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs, tools=tools)
        except InvalidRequestError as e:
            raise OpenAIError(str(e), 400, e.param) from None

    @staticmethod
    def _completion_prompts(prompt) -> list[str | list[int]]:
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    async def _make_choices(self, response_id: str, prompts: list[str | list[int]],
                            params: SamplingParams, request: SamplingRequest, param: str,
                            rank_header: str | None,
                            trace_headers: Mapping[str, str] | None = None) -> list[Choice]:
        """Check the X-data-parallel-rank header and build every prompt's engine request, then
        make n choices per prompt, each traced under trace_headers (each its own span, as vLLM's
        n child requests). Nothing reaches the engine until the choices are iterated."""
        rank = self._data_parallel_rank(rank_header)
        if params.kv_transfer_params is not None and (len(prompts) > 1 or request.n > 1):
            # A response returns one set of params: those of a second engine request (blocks a
            # prefill instance would hold for nobody) would be lost.
            raise OpenAIError("kv_transfer_params needs a single prompt and n=1", 400,
                              "kv_transfer_params")
        engine_requests = [await self._process_inputs(f"{response_id}-p{i}", prompt, params,
                                                      request, rank, param)
                           for i, prompt in enumerate(prompts)]
        self._check_serving()  # again: tokenizing took a while
        choices = []
        for prompt, engine_request in zip(prompts, engine_requests):
            ids = engine_request.prompt_token_ids
            # Token ids are decoded only for echo, the one use of their text.
            shared = (Prompt(prompt, ids) if isinstance(prompt, str) else Prompt(
                self.tokenizer.decode(ids) if request.echo else "", ids, given_as_text=False))
            for j in range(request.n):
                # Each choice is an engine request of its own: n is the server's business.
                p = dataclasses.replace(
                    parallel_sample_params(engine_request.sampling_params, j), n=1)
                request_id = f"{response_id}-{len(choices)}"
                choice_request = msgspec.structs.replace(engine_request, request_id=request_id,
                                                         sampling_params=p)
                outputs = self.client.generate(
                    choice_request, prompt_text=shared.text if shared.given_as_text else None,
                    trace_headers=trace_headers)
                choices.append(Choice(len(choices), request_id, shared, outputs))
        return choices

    # ----------------------------------------------------------------------------- outputs

    def _update(self, choice: Choice, output: RequestOutput) -> str:
        """Take a choice's cumulative output; return the text that is new."""
        completion = output.outputs[0]
        delta = completion.text[len(choice.text):]
        choice.text = completion.text
        choice.token_ids = completion.token_ids
        choice.num_tokens = len(completion.token_ids)
        choice.num_cached_tokens = output.num_cached_tokens
        choice.logprobs = completion.logprobs
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            choice.finish_reason = completion.finish_reason
            choice.stop_reason = completion.stop_reason
            choice.kv_transfer_params = output.kv_transfer_params
        return delta

    async def _iterate(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) for every output of every choice, as they arrive. Use it under
        contextlib.aclosing, so that leaving early aborts what is left at once."""
        for choice in choices:
            self.running[choice.request_id] = choice
        pending: dict[asyncio.Future, Choice] = {}
        try:
            if len(choices) == 1:
                choice = choices[0]
                async for output in choice.outputs:
                    yield choice, self._update(choice, output)
            else:
                pending = {asyncio.ensure_future(anext(c.outputs)): c for c in choices}
                while pending:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for future in done:
                        choice = pending.pop(future)
                        try:
                            output = future.result()
                        except StopAsyncIteration:
                            continue
                        pending[asyncio.ensure_future(anext(choice.outputs))] = choice
                        yield choice, self._update(choice, output)
            for choice in choices:
                if choice.finish_reason is None:  # the stream ended without saying why
                    choice.finish_reason = "abort"
                    yield choice, ""
        except ValueError as e:  # AsyncLLM's own checks (a request id in use)
            raise OpenAIError(str(e), 400) from None
        finally:
            for choice in choices:
                self.running.pop(choice.request_id, None)
            if pending:
                for future in pending:
                    future.cancel()
                self._detach(self._close(choices, list(pending)))
            else:
                # Closing a stream aborts its request if it is unfinished. It does not suspend,
                # so it is safe even in a task being cancelled again and again (anyio does that).
                for choice in choices:
                    await choice.outputs.aclose()

    async def _close(self, choices: list[Choice], cancelled: list[asyncio.Future]) -> None:
        """Close the streams of a merge left early, once the cancelled reads have stopped (a
        stream cannot be closed while a read is running it). A task of its own, as the request's
        task may be cancelled."""
        await asyncio.gather(*cancelled, return_exceptions=True)
        for choice in choices:
            await choice.outputs.aclose()

    def _detach(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new requests and abort those in flight (they finish as "abort")."""
        self.shutting_down = True
        logger.info("shutting down: aborting %d request(s) in flight", len(self.running))
        if not self.client.errored:
            for request_id in list(self.running):
                self._detach(self.client.abort(request_id))

    @staticmethod
    def _choice_usage(choice: Choice) -> UsageInfo:
        """One choice's usage so far (vLLM's continuous_usage_stats on stream chunks)."""
        prompt_tokens = len(choice.prompt.token_ids)
        return UsageInfo(prompt_tokens, choice.num_tokens, prompt_tokens + choice.num_tokens)

    def _usage(self, choices: list[Choice]) -> UsageInfo:
        prompts = {id(c.prompt): len(c.prompt.token_ids) for c in choices}
        prompt_tokens = sum(prompts.values())
        completion_tokens = sum(c.num_tokens for c in choices)
        usage = UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
        if self.enable_prompt_tokens_details:
            # Each prompt once, as in prompt_tokens: its first choice's hit (reversed: the first
            # write wins), since n choices are n engine requests where vLLM has one.
            cached = {id(c.prompt): c.num_cached_tokens for c in reversed(choices)}
            usage.prompt_tokens_details = PromptTokenUsageInfo(sum(cached.values()))
        return usage

    def _stream_error(self, e: Exception) -> bytes:
        if isinstance(e, OpenAIError):
            return sse(e.to_response())
        return sse(make_error(str(e), 503 if isinstance(e, EngineDeadError) else 500))

    async def _run_to_completion(self, choices: list[Choice]) -> None:
        """Drive every choice's request to its end (a non-streamed response)."""
        async with aclosing(self._iterate(choices)) as outputs:
            async for _ in outputs:
                pass

    # ---------------------------------------------------------------- everything else

    def show_models(self) -> ModelList:
        root = self.client.config.model_config.model or self.model_names[0]
        return ModelList([ModelCard(id=name, created=self.created, root=str(root),
                                    max_model_len=self.max_model_len)
                          for name in self.model_names])
