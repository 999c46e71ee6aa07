"""Tool calls in generated text, for ``flashtile serve --tool-call-parser NAME`` (vLLM's
flag and parser names).

The chat template shows the request's ``tools`` to the model; the model answers a call
in its own format, which a parser turns into OpenAI's ``tool_calls``. ``hermes`` (Hermes,
Qwen2.5, Qwen3 and others): each call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; text before the first call is the message's content. A call whose
JSON does not parse stays in the content, as text.
"""

from __future__ import annotations

import json
import uuid

TOOL_CALL_PARSERS = ("hermes",)


def _call(name: str, arguments) -> dict:
    """OpenAI's tool call: arguments as a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole answer; content None when only calls."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls, at = [], first
        while at >= 0:
            close = text.find(self.end, at)
            body = text[at + len(self.start):close if close >= 0 else len(text)]
            try:
                call = json.loads(body)
                name = call["name"]
                if not isinstance(name, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                return text, []  # not a call after all: the answer is text
            calls.append(_call(name, call.get("arguments", {})))
            at = text.find(self.start, close) if close >= 0 else -1
        content = text[:first].strip()
        return content or None, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed answer: ``feed`` each new piece of text and send what it returns as
    content (text that may still turn out to start a call is held back); ``finish``
    gives the content left and the calls, once the answer is complete."""

    def __init__(self, parser: HermesToolParser):
        self.parser, self.text, self.sent = parser, "", 0

    def feed(self, new: str) -> str:
        self.text += new
        start = self.parser.start
        at = self.text.find(start)
        if at < 0:  # hold back a tail that is a prefix of the start tag
            at = len(self.text)
            for k in range(min(len(start) - 1, len(self.text)), 0, -1):
                if self.text.endswith(start[:k]):
                    at -= k
                    break
        out = self.text[self.sent:at] if at > self.sent else ""
        self.sent = max(self.sent, at)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        # Content up to the first call, less what was sent (the whitespace parse strips).
        return self.text[self.sent:self.text.find(self.parser.start)].rstrip(), calls


def get_parser(name: str | None):
    """The parser ``name`` names (None: none)."""
    if name is None:
        return None
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: expected one of {TOOL_CALL_PARSERS}, got {name!r}")
    return HermesToolParser()
