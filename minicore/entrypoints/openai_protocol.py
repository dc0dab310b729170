"""The OpenAI API's records: requests in (pydantic), responses and errors out (msgspec).

Mirrors vllm/entrypoints/openai/protocol.py. Requests are pydantic models, as in vLLM, so FastAPI
reports type errors with the field's path; their sampling fields become a SamplingParams, whose
checks are the one source of truth for value ranges. Responses are msgspec Structs: a streamed
token costs one small JSON encode, and msgspec does that faster than pydantic (docs/BENCHMARKS.md).
kv_transfer_params (prefill/decode disaggregation) is a vLLM extension: taken in both request
bodies, and returned at the top level of whole responses ("kv_transfer_params": null when there are
none, as vLLM's model_dump shows it) but not on stream chunks, which in vLLM have no such field
either.
Every sampling field vLLM takes maps to SamplingParams as vLLM's to_sampling_params does: a field
left unset takes the generation config's default (get_diff_sampling_param), then OpenAI's.
Logprob records live in logprobs_format.py, the structured outputs fields (response_format,
structured_outputs) in response_format.py, chat messages and their tool calls in tool_records.py
(chat takes tools; the chat endpoint checks them). Refused with a 400 naming the field (never
silently ignored): the guided_* fields vLLM removed, tools on completions, suffix, best_of other
than n, beam search, logprob_token_ids, prompt_embeds, truncation_side right,
repetition_detection, thinking_token_budget. Left out: multimodal content.
"""

import uuid
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, field_validator

from minicore.entrypoints.logprobs_format import (
    ChatCompletionLogProbs,
    CompletionLogProbs,
    PromptLogprobsJSON,
)

# Re-exported (errors, chat messages): the endpoints take them from here with the requests.
from minicore.entrypoints.openai_errors import (  # noqa: F401
    OpenAIError,
    check_text_param,
    make_error,
    validation_error,
)
from minicore.entrypoints.response_format import (
    REMOVED_GUIDED_FIELDS,
    StructuredOutputsFields,
    removed_guided_message,
)
from minicore.entrypoints.tool_records import ChatMessage, DeltaMessage  # noqa: F401 (re-exported)
from minicore.sampling_params import SamplingParams

# Parameters minicore does not implement, with the values that mean "not used" (best_of equal to
# n is accepted too, as vLLM does); chat declares tools and tool_choice, completions do not.
UNSUPPORTED_PARAMS: dict[str, tuple] = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "logprob_token_ids": (None, []),
    "prompt_embeds": (None,),
    # truncate_prompt_tokens keeps the last tokens ("left"); vLLM can keep the first ones.
    "truncation_side": (None, "left"),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    **dict.fromkeys(REMOVED_GUIDED_FIELDS, (None,)),
}

# OpenAI's defaults for the sampling fields a generation config may set (vLLM's
# _DEFAULT_SAMPLING_PARAMS): a request's value wins, then the generation config's, then these.
DEFAULT_SAMPLING_PARAMS = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                           "frequency_penalty": 0.0, "temperature": 1.0, "top_p": 1.0,
                           "top_k": 0, "min_p": 0.0}

# Choices per request: each is an engine request of its own, so n is bounded like a batch.
MAX_N = 128

def random_uuid() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------- requests


class OpenAIBaseModel(BaseModel):
    # Unknown fields are allowed (clients send vendor extras) and reported in the log.
    model_config = ConfigDict(extra="allow")

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name == "best_of" and value == getattr(self, "n", 1):
                continue
            if name in UNSUPPORTED_PARAMS and value not in UNSUPPORTED_PARAMS[name]:
                raise OpenAIError(removed_guided_message(name) if name in REMOVED_GUIDED_FIELDS
                                  else f"{name} is not supported by minicore", 400, name)

    def ignored_fields(self) -> list[str]:
        return sorted(set(self.model_extra or ()) - set(UNSUPPORTED_PARAMS))


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    # vLLM's extension: usage on every chunk (only with include_usage).
    continuous_usage_stats: bool | None = False


class SamplingRequest(StructuredOutputsFields, OpenAIBaseModel):
    """The fields completions and chat completions share. None means "the default", because
    clients send explicit nulls."""
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None
    # vLLM's extension for disaggregated prefill: the KV connector's params (a JSON object).
    kv_transfer_params: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    # JSON object keys are strings: token ids as decimal strings.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    # vLLM's extension: logprob tokens spelled "token_id:N" (tokens that are no valid UTF-8 alone).
    return_tokens_as_token_ids: bool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def include_continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int | None,
                           defaults: dict | None = None) -> SamplingParams:
        """The SamplingParams this request asks for, unset fields taken from defaults (the
        generation config's); a 400 naming the parameter if it is invalid."""
        if not 1 <= self.n <= MAX_N:
            raise OpenAIError(f"n must be in [1, {MAX_N}], got {self.n}", 400, "n")
        if self.stream_options is not None and self.stream_options.model_fields_set and (
                not self.stream):
            raise OpenAIError("Stream options can only be defined when `stream=True`.", 400,
                              "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError("`prompt_logprobs` are not available when `stream=True`.", 400,
                              "prompt_logprobs")
        defaults = defaults or {}
        sampling = {name: value if (value := getattr(self, name)) is not None
                    else defaults.get(name, default)
                    for name, default in DEFAULT_SAMPLING_PARAMS.items()}
        logprobs, prompt_logprobs = self.logprobs_fields()
        structured = self.extract_structured_outputs()
        try:
            return SamplingParams(
                max_tokens=max_tokens, **sampling, seed=self.seed, n=self.n,
                stop=[] if self.stop is None else self.stop,
                stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, kv_transfer_params=self.kv_transfer_params,
                logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words or None, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                truncate_prompt_tokens=self.truncate_prompt_tokens, structured_outputs=structured)
        except ValueError as e:
            raise OpenAIError(str(e), 400, self.field_of(str(e).split(" ", 1)[0])) from None

    def logprobs_fields(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams."""
        raise NotImplementedError

    def field_of(self, name: str) -> str | None:
        """The request field a SamplingParams parameter (or InputProcessor param) comes from."""
        if name == "max_tokens":
            return self.max_tokens_field
        if name == "structured_outputs":
            return self.structured_outputs_field
        return name if name in type(self).model_fields else None

    @property
    def max_tokens_field(self) -> str:
        """The field the client gave the completion's length in."""
        return "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, value):
        """An explicit null is the default, 16 (vLLM's normalize_null_max_tokens)."""
        return 16 if value is None else value

    @property
    def echo_without_generation(self) -> bool:
        """echo with max_tokens 0: vLLM runs one token and returns only the prompt."""
        return self.echo and self.max_tokens == 0

    def logprobs_fields(self) -> tuple[int | None, int | None]:
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs, self.logprobs
        return self.logprobs, self.prompt_logprobs


class ChatMessageParam(OpenAIBaseModel):
    """A message as the client sent it; chat_utils.parse_chat_messages reads its content parts
    and the fields templates use (tool_calls, tool_call_id, name), kept as extras."""
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatTemplateFields(OpenAIBaseModel):
    """What the chat template sees, for chat completions and /tokenize."""
    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ChatTemplateFields, SamplingRequest):
    include_reasoning: bool = True  # with --reasoning-parser: the message's reasoning field
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    # The template holds the special tokens (vLLM's default for chat).
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True

    def logprobs_fields(self) -> tuple[int | None, int | None]:
        top = self.top_logprobs
        if top is not None and (top > 0 or top == -1) and not self.logprobs:
            raise OpenAIError("when using `top_logprobs`, `logprobs` must be set to true.", 400,
                              "top_logprobs")
        logprobs = top if self.logprobs else None
        if self.prompt_logprobs is None and self.echo:
            return logprobs, top
        return logprobs, self.prompt_logprobs

    def field_of(self, name: str) -> str | None:
        return "top_logprobs" if name == "logprobs" else super().field_of(name)

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens (deprecated)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class TokenizeRequest(ChatTemplateFields):
    """Either a prompt or chat messages (formatted with the chat template first)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    # vLLM's default: True for a prompt, as /v1/completions; chat messages default to False.
    add_special_tokens: bool | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# -------------------------------------------------------------------------------- responses


class PromptTokenUsageInfo(msgspec.Struct):
    # Prompt tokens whose KV came from the prefix cache (vLLM: num_cached_tokens).
    cached_tokens: int | None = None


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Only with --enable-prompt-tokens-details, as in vLLM; otherwise left out of the JSON.
    prompt_tokens_details: PromptTokenUsageInfo | msgspec.UnsetType = msgspec.UNSET


class CompletionResponseChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: CompletionLogProbs | None = None
    # vLLM's extension, when asked for (left out of the JSON otherwise).
    prompt_logprobs: PromptLogprobsJSON | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    # UNSET is left out of the JSON: stream chunks carry usage only when asked to.
    usage: UsageInfo | msgspec.UnsetType = msgspec.UNSET
    # A whole response always has it (null without a KV connector); stream chunks never do.
    kv_transfer_params: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponseChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: ChatCompletionLogProbs | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's extension (one prompt per chat request), when asked for.
    prompt_logprobs: PromptLogprobsJSON | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponseStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatCompletionLogProbs | None = None


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "minicore"
    root: str
    max_model_len: int


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


_encoder = msgspec.json.Encoder()


def to_json(record: Any) -> bytes:
    return _encoder.encode(record)


SSE_DONE = b"data: [DONE]\n\n"


def sse(record) -> bytes:
    """One server-sent event carrying a record as JSON."""
    return b"data: " + to_json(record) + b"\n\n"
