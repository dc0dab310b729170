"""The OpenAI generation endpoints: /v1/completions and /v1/chat/completions, whole or streamed.

Mirrors vllm/entrypoints/openai/serving_completion.py and serving_chat.py (in vLLM 0.32
completion/serving.py and chat_completion/serving.py) on OpenAIServingBase (serving_engine.py).
As vLLM: completions' echo puts the prompt's text, tokens and logprobs (the first one None) before
the completion's, and echo with max_tokens 0 returns the prompt alone (one token is still run);
chat's echo prepends the last message's content when it is the assistant's. Logprobs come in the
OpenAI shapes (logprobs_format.py); a stream chunk carries the logprobs of the tokens that are new
since the previous chunk, with text offsets counted by token, as vLLM does (text held back for a
stop string lags its tokens). prompt_logprobs (vLLM's extension) are on each completion choice and
at the top of a chat response. stream_options.continuous_usage_stats puts the choice's usage on
every chunk. Chat tools (tool_calls.py): the tools reach the template, named and "required" tool
choice constrain the output, and each choice's output is read back into tool calls, whole or
delta by delta, with vLLM's finish reasons; "auto" needs a tool parser (--enable-auto-tool-choice
--tool-call-parser), a thinking model's reasoning split off first (--reasoning-parser). Left out:
return_token_ids, per-request metrics.
"""

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

import msgspec

from minicore.engine.core_client import EngineDeadError
from minicore.engine.output_processor import RequestFailedError
from minicore.entrypoints.logprobs_format import LogprobsFormatter, prompt_logprobs_json
from minicore.entrypoints.openai_protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
    OpenAIError,
    random_uuid,
    sse,
)
from minicore.entrypoints.reasoning import REASONING_PARSERS, WithReasoning
from minicore.entrypoints.serving_engine import Choice, OpenAIServingBase
from minicore.entrypoints.tool_calls import ToolCallParser, check_tools
from minicore.entrypoints.tool_parsers import ToolParserManager


class OpenAIServing(OpenAIServingBase):
    def __init__(self, *args, enable_auto_tools: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # As vLLM's ParserManager.get_tool_parser: the parser serves only with auto tool choice.
        self.tool_parser_cls = (ToolParserManager.get_tool_parser(tool_parser)
                                if enable_auto_tools and tool_parser else None)
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None

    def _formatter(self, request) -> LogprobsFormatter:
        as_ids = request.return_tokens_as_token_ids
        return LogprobsFormatter(self.tokenizer, self.return_tokens_as_token_ids
                                 if as_ids is None else as_ids)

    @staticmethod
    def _new_tokens(choice: Choice) -> tuple[list[int], list | None]:
        """The tokens generated since the choice's last chunk, with their logprobs (None when
        not asked for); marks them sent."""
        start, choice.num_logprobs_sent = choice.num_logprobs_sent, len(choice.token_ids)
        logprobs = None if choice.logprobs is None else choice.logprobs[start:len(choice.token_ids)]
        return choice.token_ids[start:], logprobs

    # ---------------------------------------------------------------------- completions

    async def create_completion(self, request: CompletionRequest, rank_header: str | None = None,
                                trace_headers: Mapping[str, str] | None = None):
        """A CompletionResponse, or for stream=True an async iterator of SSE bytes. rank_header:
        the X-data-parallel-rank header, the engine to run on; trace_headers: the request's W3C
        trace context (get_trace_headers), its spans' parent."""
        self._check_request(request)
        prompts = self._completion_prompts(request.prompt)
        max_tokens = 1 if request.echo_without_generation else request.max_tokens
        params = self.sampling_params(request, max_tokens)
        response_id = f"cmpl-{random_uuid()}"
        choices = await self._make_choices(response_id, prompts, params, request, "prompt",
                                           rank_header, trace_headers)
        model = request.model or self.model_names[0]
        if request.stream:
            return self._completion_stream(request, response_id, model, choices)
        await self._run_to_completion(choices)
        fmt = self._formatter(request)
        return CompletionResponse(
            id=response_id, created=int(time.time()), model=model,
            choices=[self._completion_choice(request, c, fmt) for c in choices],
            usage=self._usage(choices), kv_transfer_params=choices[0].kv_transfer_params)

    @staticmethod
    def _completion_choice(request: CompletionRequest, c: Choice,
                           fmt: LogprobsFormatter) -> CompletionResponseChoice:
        """vLLM's request_output_to_completion_response for one choice."""
        text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
        if request.echo_without_generation:
            text, token_ids, logprobs = c.prompt.text, c.prompt.token_ids, c.prompt_logprobs
        elif request.echo:
            text, token_ids = c.prompt.text + c.text, c.prompt.token_ids + c.token_ids
            if logprobs is not None:
                logprobs = [*(c.prompt_logprobs or []), *logprobs]
        result = CompletionResponseChoice(c.index, text, c.finish_reason, c.stop_reason)
        if request.logprobs is not None and logprobs is not None:
            result.logprobs = fmt.completion(token_ids, logprobs, request.logprobs)
        if c.prompt_logprobs is not None:
            result.prompt_logprobs = prompt_logprobs_json(c.prompt_logprobs)
        return result

    async def _completion_stream(self, request: CompletionRequest, response_id: str, model: str,
                                 choices: list[Choice]) -> AsyncIterator[bytes]:
        created, fmt = int(time.time()), self._formatter(request)
        try:
            async with aclosing(self._iterate(choices)) as outputs:
                async for choice, delta in outputs:
                    if (chunk := self._completion_chunk(request, choice, delta, fmt)) is None:
                        continue
                    response = CompletionResponse(id=response_id, created=created, model=model,
                                                  choices=[chunk])
                    if request.include_continuous_usage:
                        response.usage = self._choice_usage(choice)
                    yield sse(response)
            if request.include_usage:
                yield sse(CompletionResponse(id=response_id, created=created, model=model,
                                             choices=[], usage=self._usage(choices)))
        except (OpenAIError, EngineDeadError, RequestFailedError) as e:
            yield self._stream_error(e)
        yield SSE_DONE

    def _completion_chunk(self, request: CompletionRequest, choice: Choice, delta: str,
                          fmt: LogprobsFormatter) -> CompletionResponseChoice | None:
        """The stream choice for a choice's new output, None when there is nothing to send: the
        echoed prompt goes first, with the first tokens (once there are any)."""
        finished = choice.finish_reason is not None
        if request.echo and not choice.echoed:
            if not choice.token_ids and not finished:
                return None  # prefill: the prompt goes out with the first token
            choice.echoed = True
            token_ids, logprobs = self._new_tokens(choice)
            if request.echo_without_generation:
                delta, token_ids, logprobs = (choice.prompt.text, choice.prompt.token_ids,
                                              choice.prompt_logprobs)
            else:
                delta, token_ids = choice.prompt.text + delta, choice.prompt.token_ids + token_ids
                if logprobs is not None:
                    logprobs = [*(choice.prompt_logprobs or []), *logprobs]
        elif request.echo_without_generation:
            if not finished:
                return None
            delta, token_ids, logprobs = "", [], None
        else:
            token_ids, logprobs = self._new_tokens(choice)
        new_logprobs = request.logprobs is not None and logprobs is not None
        if not (delta or finished or (new_logprobs and token_ids)):
            return None
        chunk = CompletionResponseChoice(choice.index, delta, choice.finish_reason,
                                         choice.stop_reason)
        if new_logprobs:
            chunk.logprobs = fmt.completion(token_ids, logprobs, request.logprobs,
                                            choice.text_offset)
            if chunk.logprobs.tokens:  # offsets advance by the tokens sent, not the text
                choice.text_offset = chunk.logprobs.text_offset[-1] + len(chunk.logprobs.tokens[-1])
        return chunk

    # ----------------------------------------------------------------- chat completions

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     rank_header: str | None = None,
                                     trace_headers: Mapping[str, str] | None = None):
        """A ChatCompletionResponse, or for stream=True an async iterator of SSE bytes."""
        self._check_request(request)
        tools = check_tools(request, self.tool_parser_cls)
        conversation, text = self.render_chat(request, tools.tools)
        requested = self.sampling_params(request, request.requested_max_tokens)
        params = tools.sampling_params(requested)
        response_id = f"chatcmpl-{random_uuid()}"
        try:
            choices = await self._make_choices(response_id, [text], params, request, "messages",
                                               rank_header, trace_headers)
        except OpenAIError as e:
            # A constraint the engine refuses that tool choice set: the tools' own schema.
            if e.param == "structured_outputs" and (
                    params.structured_outputs is not requested.structured_outputs):
                raise OpenAIError(e.message, 400, "tools") from None
            raise
        model = request.model or self.model_names[0]
        parsers = [tools.parser() if self.reasoning_parser is None else WithReasoning(
            self.reasoning_parser, tools.parser(), request.include_reasoning) for _ in choices]
        # vLLM's chat echo: the last message, when it is the assistant's, heads the answer.
        echo = (conversation[-1]["content"] if request.echo
                and conversation[-1]["role"] == "assistant" else "")
        if request.stream:
            return self._chat_stream(request, response_id, model, choices, parsers, echo)
        await self._run_to_completion(choices)
        fmt = self._formatter(request)
        prompt_logprobs = choices[0].prompt_logprobs
        return ChatCompletionResponse(
            id=response_id, created=int(time.time()), model=model,
            choices=[self._chat_choice(request, c, parsers[c.index], echo, fmt) for c in choices],
            usage=self._usage(choices), kv_transfer_params=choices[0].kv_transfer_params,
            prompt_logprobs=msgspec.UNSET if prompt_logprobs is None
            else prompt_logprobs_json(prompt_logprobs))

    def _chat_choice(self, request: ChatCompletionRequest, c: Choice, parser: ToolCallParser,
                     echo: str, fmt: LogprobsFormatter) -> ChatCompletionResponseChoice:
        message, finish_reason = parser.parse(c.text, c.finish_reason)
        if echo:
            message.content = echo + (message.content or "")
        return ChatCompletionResponseChoice(
            c.index, message, finish_reason, c.stop_reason,
            self._chat_logprobs(request, c.token_ids, c.logprobs, fmt))

    @staticmethod
    def _chat_logprobs(request: ChatCompletionRequest, token_ids: list[int], logprobs,
                       fmt: LogprobsFormatter):
        if not request.logprobs or logprobs is None:
            return None
        return fmt.chat(token_ids, logprobs, request.top_logprobs)

    async def _chat_stream(self, request: ChatCompletionRequest, response_id: str, model: str,
                           choices: list[Choice], parsers: list[ToolCallParser],
                           echo: str) -> AsyncIterator[bytes]:
        created, fmt = int(time.time()), self._formatter(request)

        def chunk(choice_list, usage=None):
            response = ChatCompletionStreamResponse(id=response_id, created=created, model=model,
                                                    choices=choice_list)
            if usage is not None:
                response.usage = usage
            return sse(response)

        def continuous(choice: Choice):
            return self._choice_usage(choice) if request.include_continuous_usage else None

        # As OpenAI: each choice opens with the role, then the content comes in deltas.
        for c in choices:
            yield chunk([ChatCompletionResponseStreamChoice(
                c.index, DeltaMessage("assistant", ""))], continuous(c))
            if echo:
                yield chunk([ChatCompletionResponseStreamChoice(c.index, DeltaMessage(
                    content=echo))], continuous(c))
        try:
            async with aclosing(self._iterate(choices)) as outputs:
                async for choice, delta in outputs:
                    token_ids, logprobs = self._new_tokens(choice)
                    logprobs = self._chat_logprobs(request, token_ids, logprobs, fmt)
                    parser = parsers[choice.index]
                    message = parser.parse_delta(delta, choice.finish_reason)
                    finish_reason = parser.stream_finish_reason(choice.finish_reason)
                    if message is not None or finish_reason is not None or (
                            logprobs and token_ids):
                        yield chunk([ChatCompletionResponseStreamChoice(
                            choice.index, message or DeltaMessage(), finish_reason,
                            choice.stop_reason, logprobs)], continuous(choice))
            if request.include_usage:
                yield chunk([], self._usage(choices))
        except (OpenAIError, EngineDeadError, RequestFailedError) as e:
            yield self._stream_error(e)
        yield SSE_DONE
