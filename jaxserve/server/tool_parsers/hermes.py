"""Hermes' (NousResearch; also Qwen 2.5 and 3) tool calls: each call a JSON object in
`<tool_call>...</tool_call>` tags, `{"name": ..., "arguments": {...}}`."""

from __future__ import annotations

import json
import re

from jaxserve.server.tool_parsers import ParsedCall, partial_marker

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def extract(text: str) -> tuple[str | None, list[ParsedCall]]:
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, []   # not a well-formed call: the reply is plain text
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append(ParsedCall(call["name"], json.dumps(call.get("arguments") or {})))
    # The text before the first call, as a stream sent it (None when there is none but space).
    content = text[:text.find(START)] if calls else text
    return content if content.strip() else None, calls


def call_start(text: str) -> int:
    return partial_marker(text, START)


def tools_prompt(tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(tool) for tool in tools)
    return ("You are a function calling AI model. You may call one or more functions to assist with the user "
            f"query. Here are the available tools: <tools>\n{signatures}\n</tools>\nFor each function call, "
            f"return a JSON object with the function name and arguments within {START}{END} tags:\n"
            f'{START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{END}')


def format_call(name: str, arguments: str) -> str:
    return f'{START}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{END}'
