"""Tool-call parsers on canned replies (vLLM's documented formats), and a streamed reply split
into pieces reassembling to the whole reply's content and calls."""

import json

import pytest

from jaxserve.server.openai_protocol import ChatCompletionRequest
from jaxserve.server.tool_calls import ToolReply
from jaxserve.server.tool_parsers import ParsedCall, hermes, llama3_json, tool_call_parser

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedCall("get_time", '{"zone": "UTC"}')


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [WEATHER]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', "Let me check.\n", [WEATHER, TIME]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [TIME]),   # cut before the end tag
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', None, []),  # broken: stays text
])
def test_hermes(text, content, calls):
    found_content, found_calls = hermes.extract(text)
    assert found_calls == calls
    assert found_content == (content if calls else text)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', [WEATHER]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC"}}', [WEATHER, TIME]),
    ('{"name": "get_time", "arguments": {"zone": "UTC"}}', [TIME]),
    ("The weather is fine.", []),
    ('{"name": "get_time", "parameters": ', []),
])
def test_llama3_json(text, calls):
    content, found = llama3_json.extract(text)
    assert found == calls and (content is None) == bool(calls)


def test_each_parser_reads_back_the_calls_it_writes():
    for parser in (hermes, llama3_json):
        text = "\n".join(parser.format_call(c.name, c.arguments) for c in (WEATHER,))
        assert parser.extract(text)[1] == [WEATHER]
        assert "get_weather" in parser.tools_prompt([{"type": "function", "function": {"name": "get_weather"}}])
    with pytest.raises(ValueError, match="not one of"):
        tool_call_parser("mistral")


def body(tool_choice="auto"):
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Hi"}], "tool_choice": tool_choice,
        "tools": [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]})


@pytest.mark.parametrize("tool_choice, parser, text", [
    ("auto", "hermes", 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    ("auto", "hermes", "No call here, <tool but not a tag."),
    ("auto", "hermes", '\n <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    ("auto", "llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("required", None, '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", '
                       '"parameters": {"city": "Oslo"}}]'),
    ({"type": "function", "function": {"name": "get_time"}}, None, '{"zone": "UTC"}'),
])
def test_streamed_pieces_reassemble_to_the_whole_reply(tool_choice, parser, text):
    whole = ToolReply(body(tool_choice), parser).message(text)
    stream, content, calls = ToolReply(body(tool_choice), parser), "", {}
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        delta = stream.delta(piece, i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for part in delta.tool_calls or ():
            name, arguments = calls.get(part.index, ("", ""))
            calls[part.index] = (name + (part.function.name or ""), arguments + part.function.arguments)
    assert content == (whole.content or "")
    assert [calls[i] for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                 for c in whole.tool_calls or ()]
    if whole.tool_calls:
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in whole.tool_calls)
        assert stream.finish_reason(text, "stop") == "tool_calls"
