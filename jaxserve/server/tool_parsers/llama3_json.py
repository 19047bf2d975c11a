"""Llama 3.1-3.3's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`), several calls separated by `;`."""

from __future__ import annotations

import json

from jaxserve.server.tool_parsers import ParsedCall, partial_marker

PYTHON_TAG = "<|python_tag|>"


def extract(text: str) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text or None, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            call, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(call.get("name") if isinstance(call, dict) else None, str) or not isinstance(
                arguments or {}, dict):
            return text, []
        calls.append(ParsedCall(call["name"], json.dumps(arguments or {})))
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return None, calls


def call_start(text: str) -> int:
    """A reply that is a call starts with it: hold everything back until it cannot be one."""
    stripped = text.lstrip()
    if not stripped or stripped.startswith("{") or partial_marker(stripped, PYTHON_TAG) == 0:
        return 0
    return len(text)


def tools_prompt(tools: list[dict]) -> str:
    signatures = "\n\n".join(json.dumps(tool) for tool in tools)
    return ("Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\nRespond in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{signatures}")


def format_call(name: str, arguments: str) -> str:
    return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'
