"""Reasoning parsers: a thinking model's output split into its reasoning and its answer, whole
and streamed (--reasoning-parser).

Mirrors vllm/reasoning/ (ReasoningParserManager, DeepSeekR1ReasoningParser,
Qwen3ReasoningParser): the reasoning is what the model writes between <think> and </think>; it
comes back as the message's reasoning field (vLLM 0.32's name; reasoning_content before) and
streams as delta.reasoning, unless the request sets include_reasoning false; the rest is the
content, which the tool call parser then reads. deepseek_r1 takes everything before </think> as
reasoning, <think> or not (DeepSeek-R1's template writes it into the prompt), and all of an output
without </think>; qwen3 needs both tags, else the whole output is content. Streamed, the output so
far is split again at each delta and what is new of each part goes out, a partial tag held back.
A request's grammar starts once its reasoning ends (minicore/structured_output/reasoning.py).
Left out: token-id based detection.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from minicore.entrypoints.tool_parsers.utils import partial_tag_overlap
from minicore.entrypoints.tool_records import ChatMessage, DeltaMessage


class ReasoningParser:
    """One model family's tags; registered by name in REASONING_PARSERS."""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether the output must open with the start tag to hold any reasoning.
    needs_start: ClassVar[bool] = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of an output; not final, a partial tag is held back."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif not final and stripped and self.start.startswith(stripped):
            return "", ""  # the start tag may be coming
        elif not self.needs_start:
            body = text
        else:
            return "", text
        end = body.find(self.end)
        if end != -1:
            return body[:end], body[end + len(self.end):]
        if final and self.needs_start:
            return "", text  # never closed: all content, as vLLM's qwen3
        return body[:len(body) - (0 if final else partial_tag_overlap(body, self.end))], ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass


class Qwen3ReasoningParser(ReasoningParser):
    needs_start = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}


@dataclass(slots=True)
class WithReasoning:
    """A choice's output parser (ToolCallParser) behind a reasoning parser: the reasoning split
    off first, the content handed on."""
    reasoning: ReasoningParser
    inner: Any
    include: bool
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def parse(self, text: str, finish_reason: str) -> tuple[ChatMessage, str]:
        reasoning, content = self.reasoning.split(text, final=True)
        message, finish_reason = self.inner.parse(content, finish_reason)
        if reasoning and not message.content:
            message.content = None  # all reasoning: no answer (vLLM's null content)
        if self.include and reasoning:
            message.reasoning = reasoning
        return message, finish_reason

    def parse_delta(self, delta_text: str, finish_reason: str | None) -> DeltaMessage | None:
        self.text += delta_text
        reasoning, content = self.reasoning.split(self.text, final=finish_reason is not None)
        new_reasoning = reasoning[self.sent_reasoning:]
        new_content = content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        message = (self.inner.parse_delta(new_content, finish_reason)
                   if new_content or finish_reason is not None else None)
        if self.include and new_reasoning:
            message = message or DeltaMessage()
            message.reasoning = new_reasoning
        return message

    def stream_finish_reason(self, finish_reason: str | None) -> str | None:
        return self.inner.stream_finish_reason(finish_reason)
