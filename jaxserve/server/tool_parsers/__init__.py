"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`, vLLM's names): each knows one
model family's way of writing a call, to find the calls in a reply and, for a chat template with
no tools support of its own, to describe the tools and write earlier calls into the prompt.

A parser is a module-level object with:
  `extract(text) -> (content or None, [ParsedCall])`: the reply's plain text and its calls;
  `call_start(text) -> int`: where a call may begin in a partial reply (len(text): nowhere yet),
      so that a stream holds back what may turn out to be a call;
  `tools_prompt(tools) -> str`: a system prompt offering the tools (function definitions);
  `format_call(name, arguments) -> str`: an earlier call as the model would have written it.
"""

from __future__ import annotations

import dataclasses

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str   # JSON text of an object


def tool_call_parser(name: str):
    from jaxserve.server.tool_parsers import hermes, llama3_json

    parsers = {"hermes": hermes, "llama3_json": llama3_json}
    if name not in parsers:
        raise ValueError(f"tool_call_parser={name!r} is not one of {TOOL_CALL_PARSERS}")
    return parsers[name]


def partial_marker(text: str, marker: str) -> int:
    """Where `marker` starts in `text`, or where a prefix of it ends the text; else len(text)."""
    found = text.find(marker)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)
