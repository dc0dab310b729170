"""The request side of structured outputs: the response_format and structured_outputs records and
their conversion to the StructuredOutputsParams the engine runs.

Mirrors ResponseFormat, JsonSchemaResponseFormat and structured_outputs_from_response_format in
vllm/entrypoints/generate/base/protocol.py, with the requests' checks of
vllm/entrypoints/openai/chat_completion/protocol.py and completion/protocol.py: structured_outputs
holds exactly one constraint; response_format json_object / json_schema replaces that field of it
(vLLM's replace), so a constraint of another kind beside it is a 400. The constraint itself is
checked (vLLM's checks, nesting depth included, then a compile) by the InputProcessor, whose 400
names the field it came from. A structural_tag response_format is passed on whole as the tag, as
vLLM does. Refused with a 400 naming the request field: whitespace_pattern,
disable_additional_properties, disable_fallback, and the guided_* fields vLLM removed (it ignores
them, leaving the output unconstrained). Stricter than vLLM, which ignores them: unknown subfields,
a json_schema without its schema or beside another type.
"""

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minicore.entrypoints.openai_errors import OpenAIError
from minicore.sampling_params import StructuredOutputsParams

# vLLM 0.32's _REMOVED_GUIDED_FIELDS (vllm/entrypoints/serve/engine/protocol.py).
REMOVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                         "guided_decoding_backend", "guided_whitespace_pattern")

# vLLM's StructuredOutputsParams fields minicore does not implement, with their "not used" values.
UNSUPPORTED_FIELDS = {"whitespace_pattern": (None,),
                      "disable_additional_properties": (None, False),
                      "disable_fallback": (None, False)}


def removed_guided_message(name: str) -> str:
    return (f"{name} was removed in vLLM (which now ignores it, leaving the output "
            "unconstrained); use structured_outputs or response_format instead")


class _Record(BaseModel):
    # Extra fields are kept so that they can be refused by name.
    model_config = ConfigDict(extra="allow")


class JsonSchemaResponseFormat(_Record):
    name: str
    description: str | None = None
    # "schema" would shadow BaseModel.schema: vLLM's alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # Ignored as in vLLM: the schema is always enforced.
    strict: bool | None = None


class ResponseFormat(_Record):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(_Record):
    """vLLM's StructuredOutputsParams as a request field (json aliased: it would shadow
    BaseModel.json)."""
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False


class StructuredOutputsFields(BaseModel):
    """The request fields of structured outputs, taken by completions and chat completions."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def extract_structured_outputs(self) -> StructuredOutputsParams | None:
        """vLLM's: the constraint asked for, None for none; a 400 naming the field at fault."""
        return structured_outputs_from_response_format(self.structured_outputs,
                                                       self.response_format)

    @property
    def structured_outputs_field(self) -> str:
        """The field the request's constraint came from: response_format's json_object or
        json_schema replaces structured_outputs'."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs"


def structured_outputs_from_response_format(structured_outputs: StructuredOutputsRequest | None,
                                            response_format: ResponseFormat | None
                                            ) -> StructuredOutputsParams | None:
    """vLLM's function of that name, with the checks above."""
    params = None if structured_outputs is None else _from_structured_outputs(structured_outputs)
    override = None if response_format is None else _response_format_override(response_format)
    if override is None:
        return params
    if params is not None and params.kind != next(iter(override)):
        raise OpenAIError(f"response_format {response_format.type} and structured_outputs."
                          f"{params.kind} are two constraints; a request takes one", 400,
                          "response_format")
    return (StructuredOutputsParams(**override) if params is None
            else dataclasses.replace(params, **override))


def _from_structured_outputs(request: StructuredOutputsRequest) -> StructuredOutputsParams:
    _check_extras(request, "structured_outputs", UNSUPPORTED_FIELDS)
    try:
        return StructuredOutputsParams(
            json=request.json_, regex=request.regex, choice=request.choice,
            grammar=request.grammar, json_object=request.json_object,
            structural_tag=request.structural_tag,
            disable_any_whitespace=request.disable_any_whitespace)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "structured_outputs") from None


def _response_format_override(response_format: ResponseFormat) -> dict[str, Any] | None:
    """The field of StructuredOutputsParams response_format sets (None for type text)."""
    kind = response_format.type
    if kind == "structural_tag":  # the whole object is the tag, as vLLM passes it on
        return {"structural_tag": json.dumps(response_format.model_dump(by_alias=True,
                                                                        exclude_none=True))}
    _check_extras(response_format, "response_format")
    schema = response_format.json_schema
    if kind != "json_schema":
        if schema is not None:
            raise OpenAIError(f"response_format.json_schema is only used with type json_schema, "
                              f"not {kind}", 400, "response_format")
        return None if kind == "text" else {"json_object": True}
    if schema is None:  # vLLM's message
        raise OpenAIError("When response_format type is 'json_schema', the 'json_schema' field "
                          "must be provided.", 400, "response_format")
    _check_extras(schema, "response_format.json_schema")
    if schema.json_schema is None:
        raise OpenAIError("response_format.json_schema.schema must be given (a JSON schema)",
                          400, "response_format")
    return {"json": schema.json_schema}


def _check_extras(record: BaseModel, path: str, unsupported: dict[str, tuple] | None = None):
    """A 400 for a field the record does not have, or one minicore does not implement used."""
    for name, value in (record.model_extra or {}).items():
        if name not in (unsupported or {}):
            raise OpenAIError(f"{path} has no field {name!r}", 400, path.split(".")[0])
        if value not in unsupported[name]:
            raise OpenAIError(f"{path}.{name} is not supported by minicore", 400,
                              path.split(".")[0])
