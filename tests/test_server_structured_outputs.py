"""Structured outputs over HTTP on the embedded SmolLM2, with the official `openai` client:
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields, and bad input."""

import json
import re
from typing import Literal

import pytest
import requests
from pydantic import BaseModel, Field

from server_fixtures import openai_client, serving, smollm2_engine  # noqa: F401 - fixture

pytestmark = pytest.mark.slow
MODEL = "test-model"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


class Pet(BaseModel):
    species: Literal["cat", "dog", "parrot"]
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=30)


class Household(BaseModel):
    family_name: str = Field(max_length=16)
    pets: list[Pet] = Field(max_length=2)
    city: City


class Verdict(BaseModel):
    sentiment: Literal["positive", "negative", "neutral"]
    confidence: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with serving(smollm2_engine, max_n=4) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("schema, question", [
    (Household, "Describe a family with a pet as JSON."),
    (Verdict, "Review: 'I loved this film.' Give the sentiment as JSON."),
])
def test_parse_returns_the_pydantic_object(client, schema, question):
    reply = client.chat.completions.parse(model=MODEL, messages=ask(question), response_format=schema,
                                          temperature=0, max_tokens=200)
    [choice] = reply.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, schema)
    assert schema.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_valid_json(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("Give me a JSON object about a cat."),
                                           response_format={"type": "json_object"}, temperature=0.8, seed=1,
                                           max_tokens=200)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("constraint, pattern", [
    ({"choice": ["positive", "negative"]}, r"positive|negative"),
    ({"regex": r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"}, r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"),
    ({"grammar": 'root ::= "Colour: " ("red" | "green" | "blue")'}, r"Colour: (red|green|blue)"),   # GBNF
])
def test_structured_outputs_constrain_chat(client, constraint, pattern):
    reply = client.chat.completions.create(model=MODEL, messages=ask("When and where? Answer briefly."),
                                           temperature=0.8, seed=7, max_tokens=40, n=2,
                                           extra_body={"structured_outputs": constraint})
    for choice in reply.choices:
        assert re.fullmatch(pattern, choice.message.content), choice.message.content
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize("field, value, pattern", [
    ("guided_choice", ["alpha", "beta"], r"alpha|beta"),
    ("guided_regex", r"[0-9]{3}", r"[0-9]{3}"),
    ("guided_json", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}, r'\{"ok": (true|false)\}'),
    ("guided_grammar", 'start: "A" | "B"', r"A|B"),
])
def test_older_guided_fields_are_honoured_on_completions(client, field, value, pattern):
    reply = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=0,
                                      extra_body={field: value})
    assert re.fullmatch(pattern, reply.choices[0].text), reply.choices[0].text


def test_completions_take_response_format(server):
    body = {"prompt": "A JSON object describing a dog:", "max_tokens": 120, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}}}
    reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    Pet.model_validate_json(reply.json()["choices"][0]["text"])


def test_generate_takes_structured_outputs(server):
    body = {"prompt": "Is water wet?", "max_tokens": 10, "structured_outputs": {"choice": ["yes", "no"]}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["output_text"] in ("yes", "no")


def test_streamed_text_equals_the_reply_for_the_same_seed(client):
    request = dict(model=MODEL, messages=ask("Describe Rome as JSON."), temperature=0.9, seed=11, max_tokens=120,
                   response_format={"type": "json_schema", "json_schema": {
                       "name": "city", "schema": City.model_json_schema(), "strict": True}})
    whole = client.chat.completions.create(**request).choices[0]
    parts, reason = [], None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    assert ("".join(parts), reason) == (whole.message.content, whole.finish_reason)
    City.model_validate_json(whole.message.content)


@pytest.mark.parametrize("extra, param, message", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one choice"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs", "frobnicate"),
    ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs", "missing"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern", "not a supported parameter"),
    ({"guided_regex": "[0-9"}, "guided_regex", "regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "give one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "give one"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs", "--max-structured-output-bytes"),
])
def test_bad_constraints_get_400_naming_the_field_and_the_server_goes_on(server, extra, param, message):
    body = {"messages": ask("Hi"), "max_tokens": 4, **extra}
    reply = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    after = requests.post(f"{server.url}/v1/chat/completions", json={"messages": ask("Hi"), "max_tokens": 2},
                          timeout=60)
    assert after.status_code == 200
    assert server.async_engine.stats.kv_cache_usage == 0
