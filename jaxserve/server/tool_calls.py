"""OpenAI tool calling on chat: tools into the prompt, calls out of the reply, streamed or not.

How a reply becomes calls depends on `tool_choice`:
  named     the reply was constrained to the function's arguments (a JSON object): one call;
  required  the reply was constrained to a JSON list of {"name", "parameters"}: its items;
  auto      the model chose; `--tool-call-parser` finds the calls it wrote, if any;
  none      the reply is text.
A chat template that knows tools gets them (and earlier calls) in its own format; for one that
does not, the parser's format describes them in a system message (hermes' when there is none).
"""

from __future__ import annotations

import json
import uuid

from jaxserve.server.openai_protocol import (
    AssistantMessage, ChatCompletionRequest, ChatMessage, Delta, FunctionCall, FunctionCallDelta, ToolCall,
    ToolCallDelta)
from jaxserve.server.tool_parsers import ParsedCall, hermes, tool_call_parser


def conversation(body: ChatCompletionRequest, template: str | None,
                 parser_name: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them, and the tools to give the template (None:
    the template does not know tools, and a system message describes them instead)."""
    offered = [t.model_dump(exclude_none=True) for t in body.tools or ()] if body.tool_mode() != "none" else []
    native = "tools" in (template or "")
    parser = tool_call_parser(parser_name) if parser_name else hermes
    messages = [_message(m, native, parser) for m in body.messages]
    if offered and not native:
        prompt = parser.tools_prompt(offered)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, (offered or None) if native else None


def _message(message: ChatMessage, native: bool, parser) -> dict:
    # "developer" is OpenAI's newer name for "system"; templates know only the latter.
    out = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    calls = message.tool_calls or ()
    if native:
        if calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in calls]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
    elif calls:
        out["content"] = "\n".join([out["content"]] * bool(out["content"]) + [
            parser.format_call(c.function.name, c.function.arguments) for c in calls])
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ToolReply:
    """Turns one choice's reply into content and calls, for a whole reply or streamed pieces."""

    def __init__(self, body: ChatCompletionRequest, parser_name: str | None):
        self.mode = body.tool_mode()
        self.name = body.tool_choice.function.name if self.mode == "named" else None
        self.parser = tool_call_parser(parser_name) if self.mode == "auto" else None
        self._text = ""        # streamed so far
        self._sent = 0         # characters of it sent as content
        self._call_id = None   # a named call's, once its first piece is out

    def message(self, text: str) -> AssistantMessage:
        content, calls = self._split(text)
        return AssistantMessage(content=content, tool_calls=[_tool_call(c) for c in calls] or None)

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._split(text)[1] else reason

    def _split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.mode == "named":
            return None, [ParsedCall(self.name, text)]
        if self.mode == "required":
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            return self.parser.extract(text)
        return text, []

    @property
    def text(self) -> str:
        """The reply streamed so far."""
        return self._text

    def delta(self, piece: str, finished: bool) -> Delta | None:
        """What a stream sends for the reply's next `piece` (None: nothing yet)."""
        self._text += piece
        if self.mode == "none":
            return Delta(content=piece) if piece else None
        if self.mode == "named":
            if self._call_id is None:
                self._call_id = _call_id()
                return Delta(tool_calls=[ToolCallDelta(index=0, id=self._call_id, type="function",
                                                       function=FunctionCallDelta(name=self.name, arguments=piece))])
            return Delta(tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=piece))]) \
                if piece else None
        held = self.parser.call_start(self._text) if self.mode == "auto" else 0
        if not self._text[:held].strip():
            held = 0   # space alone before a call is no content (as `message` says)
        content = self._text[self._sent:held] if not finished else ""
        self._sent += len(content)
        if not finished:
            return Delta(content=content) if content else None
        return self._final_delta()

    def _final_delta(self) -> Delta | None:
        content, calls = self._split(self._text)
        rest = (content or "")[self._sent:]   # the text before any calls went out as it came
        deltas = [d for i, call in enumerate(calls) for d in (
            ToolCallDelta(index=i, id=_call_id(), type="function", function=FunctionCallDelta(name=call.name,
                                                                                              arguments="")),
            ToolCallDelta(index=i, function=FunctionCallDelta(arguments=call.arguments)))]
        if not rest and not deltas:
            return None
        return Delta(content=rest or None, tool_calls=deltas or None)


def _required_calls(text: str) -> list[ParsedCall]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []   # cut short (max_tokens): the reply stays text
    return [ParsedCall(item["name"], json.dumps(item["parameters"])) for item in items]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))

