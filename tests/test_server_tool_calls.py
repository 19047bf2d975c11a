"""Tool calling on chat with the official `openai` client, on the embedded SmolLM2: constrained
calls (tool_choice required, a named function), auto with a parser, streaming, tool messages."""

import json

import jsonschema_rs
import pytest
import requests

from server_fixtures import openai_client, serving, smollm2_engine, tiny_engine  # noqa: F401 - fixture

pytestmark = pytest.mark.slow
MODEL = "test-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 20}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with serving(smollm2_engine, max_n=4, enable_auto_tool_choice=True, tool_call_parser="hermes") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))


def streamed(client, **request) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish reason) reassembled from a stream's deltas."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                name, arguments = calls.get(part.index, ("", ""))
                calls[part.index] = (name + (part.function.name or ""), arguments + (part.function.arguments or ""))
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_calls_that_match_their_schemas(client, parallel):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, temperature=0, max_tokens=150)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    assert parallel or len(choice.message.tool_calls) == 1


def test_a_named_function_is_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           temperature=0.7, seed=3, max_tokens=80, n=2)
    for c in reply.choices:
        assert c.finish_reason == "tool_calls"
        [call] = c.message.tool_calls
        check_calls([call], {"get_time"})


@pytest.mark.parametrize("tool_choice", ["required", "auto"])   # a named function: as required
def test_streamed_calls_reassemble_to_the_reply(client, tool_choice):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0.8, seed=5,
                   max_tokens=150)
    [whole] = client.chat.completions.create(**request).choices
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert streamed(client, **request) == (whole.message.content or "", calls, whole.finish_reason)


def test_streamed_logprobs_of_a_call_are_all_sent(client):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=150,
                   logprobs=True, top_logprobs=1)
    [whole] = client.chat.completions.create(**request).choices
    tokens = [t.token for chunk in client.chat.completions.create(**request, stream=True)
              for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content]
    assert tokens == [t.token for t in whole.logprobs.content]


def test_a_tool_message_continues_the_conversation(client, smollm2_engine):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=150).choices[0].message
    [call] = first.tool_calls[:1]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40)
    [choice] = reply.choices
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    without_result = client.chat.completions.create(model=MODEL, messages=messages[:2], tools=TOOLS,
                                                    tool_choice="none", temperature=0, max_tokens=1)
    result_tokens = len(smollm2_engine.tokenizer.encode(messages[2]["content"], add_special_tokens=False))
    assert reply.usage.prompt_tokens >= without_result.usage.prompt_tokens + result_tokens


def test_the_prompt_offers_the_tools_and_renders_calls_and_results(smollm2_engine):
    from jaxserve.server.openai_protocol import ChatCompletionRequest
    from jaxserve.server.tool_calls import conversation

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    body = ChatCompletionRequest.model_validate({"tools": TOOLS, "messages": [
        *ASK, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "9:00"}]})
    messages, tools = conversation(body, smollm2_engine.tokenizer.chat_template, "hermes")
    assert tools is None   # SmolLM2's template knows no tools: a system message describes them
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'}
    assert messages[3] == {"role": "tool", "content": "9:00"}
    native, tools = conversation(body, "{% for tool in tools %}{{ tool }}{% endfor %}", "hermes")
    assert tools == TOOLS and native[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice", "launch"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
      "tool_choice": "required"}, "tool_choice", "does not compile"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "give one"),
])
def test_bad_tool_requests_get_400(server, body, param, message):
    reply = requests.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body},
                          timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_auto_needs_the_flag(tiny_engine):
    with serving(tiny_engine) as server:
        reply = requests.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS},
                              timeout=60)
        neutral = requests.post(f"{server.url}/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 3, "tools": [], "tool_choice": "none", "parallel_tool_calls": True},
            timeout=60)
    assert reply.status_code == 400 and "--enable-auto-tool-choice" in reply.json()["error"]["message"]
    assert neutral.status_code == 200
