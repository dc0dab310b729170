"""Chat messages to a prompt: OpenAI messages parsed into a template conversation, then rendered.

Mirrors vllm/entrypoints/chat_utils.py (parse_chat_messages, _parse_chat_message_content,
_postprocess_messages; in vLLM 0.32 vllm/renderers/chat_utils.py) and vllm/renderers/hf.py
(safe_apply_chat_template, resolve_chat_template_kwargs). As vLLM does with the "string" content
format: text parts are joined with newlines; an assistant's tool_calls (arguments JSON parsed to a
dict, as HF templates expect) and reasoning, a tool message's tool_call_id and any message's name
are handed to the template, and so are the request's tool definitions. chat_template_kwargs are
filtered to the variables the template uses plus apply_chat_template's own parameters;
chat_template and tokenize in them are refused.
The server and the offline LLM.chat both use these functions.
Left out: multimodal parts (refused, naming messages), the "openai" content format (content as a
list of dicts), developer-role conversion, Mistral tokenizers.
"""

import inspect
import json
import logging
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from minicore.engine.input_processor import InvalidRequestError

logger = logging.getLogger(__name__)

# Keys the request may not override through chat_template_kwargs (vLLM's unexpected_vars).
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize"})


def parse_chat_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages (dicts) as the conversation a chat template takes; an
    InvalidRequestError (a ValueError) naming messages for what cannot be rendered."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must not be empty (a non-empty list)", "messages")
    return [_parse_message(i, message) for i, message in enumerate(messages)]


def _parse_message(i: int, message: dict) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{i}] must be an object with a string role",
                                  "messages")
    role = message["role"]
    result: dict[str, Any] = {"role": role, "content": _content_text(i, message.get("content"))}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            tool_calls = _parse_tool_calls(i, message["tool_calls"])
            if tool_calls:  # an empty list keeps the template on its plain assistant path
                result["tool_calls"] = tool_calls
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool" and "tool_call_id" in message:
        result["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    return result


def _content_text(i: int, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{i}].content must be a string or a list of "
                                  "content parts", "messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(
                part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"messages[{i}].content: content part type {kind!r} is not supported by "
                "minicore (text parts only)", "messages")
    return "\n".join(texts)


def _parse_tool_calls(i: int, tool_calls) -> list[dict]:
    """vLLM's _postprocess_messages: function arguments given as a JSON string become a dict
    (malformed or non-object JSON becomes {} with a warning, so a history stays usable)."""
    if not isinstance(tool_calls, list):
        raise InvalidRequestError(f"messages[{i}].tool_calls must be a list", "messages")
    parsed_calls = []
    for item in tool_calls:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or item.get("type", "function") != "function":
            raise InvalidRequestError("chat completions only support assistant tool_calls "
                                      "of type 'function'", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                logger.warning("tool call %r has arguments that are not valid JSON; using {}",
                               function.get("name"))
                arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
        parsed_calls.append({**item, "function": {**function, "arguments": arguments}})
    return parsed_calls


def apply_hf_chat_template(tokenizer, conversation: list[dict], *, chat_template: str | None,
                           add_generation_prompt: bool, continue_final_message: bool = False,
                           chat_template_kwargs: dict | None = None,
                           tools: list[dict] | None = None) -> str:
    """The prompt text of a parsed conversation; an InvalidRequestError naming the field for a
    request the template (or vLLM's rules) refuses. tools: the request's tool definitions
    ({"type": "function", "function": {...}} dicts, tool_calls.check_tools), handed to the
    template as vLLM 0.32 does: a default chat_template_kwargs entry (the request's wins)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("Cannot set both `continue_final_message` and "
                                  "`add_generation_prompt` to True.", "continue_final_message")
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        raise InvalidRequestError("the model has no chat template and none was given "
                                  "(--chat-template)", "messages")
    # As vLLM, the request's kwargs win over the request fields of the same name.
    kwargs = {"add_generation_prompt": add_generation_prompt,
              "continue_final_message": continue_final_message, "tools": tools,
              **resolve_chat_template_kwargs(tokenizer, template, chat_template_kwargs or {})}
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise InvalidRequestError(f"the chat template rejected the messages: {e}",
                                  "messages") from None


def resolve_chat_template_kwargs(tokenizer, template: str, kwargs: dict) -> dict:
    """The request's chat_template_kwargs the template can see: its own variables and
    apply_chat_template's parameters; others are dropped, as vLLM does."""
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if reserved := sorted(_RESERVED_KWARGS & kwargs.keys()):
        raise InvalidRequestError(f"Found unexpected chat template kwargs from request: "
                                  f"{reserved}", "chat_template_kwargs")
    accepted = _template_variables(template) | _apply_chat_template_params(type(tokenizer))
    return {k: v for k, v in kwargs.items() if k in accepted}


@lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(
            jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"the chat template is not valid Jinja: {e}",
                                  "chat_template") from None


@lru_cache(maxsize=4)
def _apply_chat_template_params(tokenizer_type: type) -> frozenset[str]:
    parameters = inspect.signature(tokenizer_type.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (
        inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)) - _RESERVED_KWARGS - {
        "self", "conversation"}
