"""The OpenAI API's records: requests in (pydantic), responses and errors out (msgspec).

Mirrors vllm/entrypoints/openai/protocol.py. Requests are pydantic models, as in vLLM, so FastAPI
reports type errors with the field's path; their sampling fields become a SamplingParams, whose
checks are the one source of truth for value ranges. Responses are msgspec Structs: a streamed
token costs one small JSON encode, and msgspec does that several times faster than pydantic.
kv_transfer_params (prefill/decode disaggregation) is a vLLM extension: taken in both request bodies,
and returned at the top level of whole responses ("kv_transfer_params": null when there are none,
as vLLM's model_dump shows it) but not on stream chunks, which in vLLM have no such field either.
Left out: logprobs, echo, suffix, penalties, logit_bias, tools and response formats (asking for
any of them is a 400, not a silent no-op), multimodal content, and beam search.
"""

import uuid
from http import HTTPStatus
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict

from minicore.sampling_params import SamplingParams, check_text

# OpenAI parameters minicore does not implement, with the values that mean "not used".
UNSUPPORTED_PARAMS: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}

# Choices per request: each is an engine request of its own, so n is bounded like a batch.
MAX_N = 128

# Error types named after the openai SDK's exception classes, as vLLM names them.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def random_uuid() -> str:
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------------- errors


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class OpenAIError(Exception):
    """A request the server refuses, with the HTTP status and the parameter to blame."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def to_response(self) -> ErrorResponse:
        return make_error(self.message, self.status, self.param)


def check_text_param(param: str, text: str) -> None:
    """Text the tokenizer and the JSON encoder can take (no lone surrogate), else a 400."""
    try:
        check_text(param, text)
    except ValueError as e:
        raise OpenAIError(str(e), 400, param) from None


def make_error(message: str, status: int, param: str | None = None) -> ErrorResponse:
    err_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return ErrorResponse(ErrorInfo(message, err_type, param, status))


def validation_error(errors: list[dict]) -> OpenAIError:
    """A 400 from pydantic's errors (a wrong type, a missing field, bad JSON): each error as
    "field.path: message", the first error's field as the param."""
    parts, params = [], []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"invalid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        field = ".".join(loc)
        params.append(loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return OpenAIError("; ".join(parts) or "invalid request", 400, params[0] if params else None)


# --------------------------------------------------------------------------------- requests


class OpenAIBaseModel(BaseModel):
    # Unknown fields are allowed (clients send vendor extras) and reported in the log.
    model_config = ConfigDict(extra="allow")

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_PARAMS and value not in UNSUPPORTED_PARAMS[name]:
                raise OpenAIError(f"{name} is not supported by minicore", 400, name)

    def ignored_fields(self) -> list[str]:
        return sorted(set(self.model_extra or ()) - set(UNSUPPORTED_PARAMS))


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The SamplingParams this request asks for; a 400 naming the parameter if it is invalid."""
        if not 1 <= self.n <= MAX_N:
            raise OpenAIError(f"n must be in [1, {MAX_N}], got {self.n}", 400, "n")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, seed=self.seed,
                stop=[] if self.stop is None else self.stop,
                stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, kv_transfer_params=self.kv_transfer_params)
        except ValueError as e:
            # SamplingParams' messages start with the parameter's name.
            name = str(e).split(" ", 1)[0]
            if name == "max_tokens":
                name = self.max_tokens_field
            param = name if name in type(self).model_fields else None
            raise OpenAIError(str(e), 400, param) from None

    @property
    def max_tokens_field(self) -> str:
        """The field the client gave the completion's length in."""
        return "max_tokens"


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None

    def to_template_dict(self) -> dict[str, str]:
        """{"role", "content"} with the content's text parts joined, as chat templates expect."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise OpenAIError("only text content parts are supported", 400, "messages")
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens (deprecated)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class TokenizeRequest(OpenAIBaseModel):
    """Either a prompt or chat messages (formatted with the chat template first)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_generation_prompt: bool = True
    # False is what the completion endpoints do, so "count" is their prompt_tokens.
    add_special_tokens: bool = False


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
    logprobs: None = None


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


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class ChatCompletionResponseChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: None = None


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
