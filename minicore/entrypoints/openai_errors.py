"""OpenAI-style errors: the records of an error body and the exception the endpoints raise.

Mirrors vLLM's ErrorResponse/ErrorInfo (vllm/entrypoints/openai/engine/protocol.py) and
create_error_response (serving_engine.py): {"error": {"message", "type", "param", "code"}}, the
type named after the openai SDK's exception class, param the request field to blame. Left out:
vLLM's VLLMValidationError value echo.
"""

from http import HTTPStatus

import msgspec

from minicore.sampling_checks import check_text

# Error types named after the openai SDK's exception classes, as vLLM names them.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               500: "InternalServerError", 503: "ServiceUnavailableError",
               # No SDK class: the HTTP phrases, written out since Python renames some.
               413: "RequestEntityTooLargeError", 431: "RequestHeaderFieldsTooLargeError"}


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
