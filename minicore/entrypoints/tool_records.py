"""The messages of chat responses with their tool calls: whole (ChatMessage) and streamed
(DeltaMessage), as msgspec Structs.

Mirrors ChatMessage (vllm/entrypoints/openai/chat_completion/protocol.py) and FunctionCall,
ToolCall, DeltaFunctionCall, DeltaToolCall and DeltaMessage
(vllm/entrypoints/generate/base/protocol.py), with their JSON shapes: a message without tool calls
has no tool_calls key, one with them has content null unless the model also wrote text; a whole
call always has id, type and function; a streamed one carries only what is new (its first delta
the id, type and name, later ones argument text), as vLLM's exclude_unset stream chunks do.
Left out: vLLM's refusal, annotations, audio and function_call message fields, and its
internal FunctionCall.id (never serialized).
"""

import uuid

import msgspec


def make_tool_call_id() -> str:
    """vLLM's default tool call id (make_tool_call_id in vllm/renderers/chat_utils.py)."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"  # vLLM's random_uuid: 16 hex


class FunctionCall(msgspec.Struct):
    name: str
    # The arguments as JSON text, as the model wrote them.
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str = msgspec.field(default_factory=make_tool_call_id)
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = []
    # A thinking model's reasoning (--reasoning-parser: minicore/entrypoints/reasoning.py).
    reasoning: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | msgspec.UnsetType = msgspec.UNSET
