"""The OpenAPI 3.1 description of the server, built from the protocol models.

Pydantic writes JSON Schema 2020-12, which is OpenAPI 3.1's schema dialect, so the models go in
as they are. `tests/test_server_fuzz.py` keeps this document true: every route is described, and
schemathesis checks the server's replies against it.
"""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from jaxserve.server import openai_protocol as protocol

_ERRORS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "No such model", 413: "Body too large",
           415: "The body is not sent as application/json",
           500: "The engine failed the request", 503: "Loading, draining, or the queue is full"}


Models = type[BaseModel] | tuple[type[BaseModel], ...]   # a tuple: any one of them


def _models(models) -> tuple:
    return models if isinstance(models, tuple) else (models,) if isinstance(models, type) else ()


@dataclasses.dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    summary: str
    reply: Models | str                     # a model (JSON), or a media type with a string body
    body: Models | None = None
    chunk: Models | None = None              # streamed (`stream: true`) as server-sent events
    errors: tuple[int, ...] = (401, 503)
    open: bool = False                       # no API key needed
    lora_updates: bool = False               # served with --enable-lora-runtime-updates only


ENDPOINTS = (
    Endpoint("post", "/generate", "Generate from one prompt", protocol.GenerateResponse,
             protocol.GenerateRequest, protocol.GenerateChunk, (400, 401, 413, 415, 500, 503)),
    Endpoint("post", "/v1/completions", "OpenAI completions", protocol.CompletionResponse,
             protocol.CompletionRequest, protocol.CompletionResponse, (400, 401, 404, 413, 415, 500, 503)),
    Endpoint("post", "/v1/chat/completions", "OpenAI chat completions", protocol.ChatCompletionResponse,
             protocol.ChatCompletionRequest, protocol.ChatCompletionChunk, (400, 401, 404, 413, 415, 500, 503)),
    Endpoint("post", "/invocations", "SageMaker's route: a chat completion if the body has messages, else a "
             "completion", (protocol.CompletionResponse, protocol.ChatCompletionResponse),
             (protocol.CompletionRequest, protocol.ChatCompletionRequest),
             (protocol.CompletionResponse, protocol.ChatCompletionChunk), (400, 401, 404, 413, 415, 500, 503)),
    Endpoint("post", "/tokenize", "Token ids of a prompt or a conversation (vLLM's)", protocol.TokenizeResponse,
             protocol.TokenizeRequest, errors=(400, 401, 404, 413, 415, 503)),
    Endpoint("post", "/detokenize", "The text of token ids (vLLM's)", protocol.DetokenizeResponse,
             protocol.DetokenizeRequest, errors=(400, 401, 404, 413, 415, 503)),
    Endpoint("get", "/v1/models", "The served model and its LoRA adapters", protocol.ModelList),
    Endpoint("get", "/v1/models/{model}", "One served model", protocol.ModelCard, errors=(401, 404, 503)),
    Endpoint("get", "/version", "The server's version", protocol.Version, errors=(401,)),
    Endpoint("get", "/health", "200 when ready, 503 while loading or draining", protocol.Health, errors=(503,),
             open=True),
    Endpoint("get", "/ping", "As /health", protocol.Health, errors=(503,), open=True),
    Endpoint("get", "/metrics", "Prometheus metrics", "text/plain", errors=(401,)),
    Endpoint("get", "/openapi.json", "This document", "application/json", errors=(401,)),
    Endpoint("post", "/v1/load_lora_adapter", "Serve a LoRA adapter from a path on the server (vLLM's)",
             "text/plain", protocol.LoadLoRAAdapterRequest, errors=(400, 401, 413, 415, 503), lora_updates=True),
    Endpoint("post", "/v1/unload_lora_adapter", "Stop serving a LoRA adapter (vLLM's)", "text/plain",
             protocol.UnloadLoRAAdapterRequest, errors=(400, 401, 404, 413, 415, 503), lora_updates=True),
)


def openapi_document(title: str, version: str, with_api_key: bool, with_lora_updates: bool = False) -> dict:
    endpoints = [e for e in ENDPOINTS if with_lora_updates or not e.lora_updates]
    bodies = {m for e in endpoints for m in _models(e.body)}
    models = {m for e in endpoints for part in (e.body, e.chunk, e.reply) for m in _models(part)}
    refs, schemas = models_json_schema(
        [(m, "validation" if m in bodies else "serialization") for m in sorted(models, key=str)]
        + [(protocol.ErrorResponse, "serialization")], ref_template="#/components/schemas/{model}")
    ref = {model: value for (model, _), value in refs.items()}
    paths: dict = {}
    for endpoint in endpoints:
        paths.setdefault(endpoint.path, {})[endpoint.method] = _operation(endpoint, ref, with_api_key)
    document = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                "components": {"schemas": schemas.get("$defs", {})}}
    if with_api_key:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"apiKey": []}]
    return document


def _operation(endpoint: Endpoint, ref: dict, with_api_key: bool) -> dict:
    if isinstance(endpoint.reply, str):
        content = {endpoint.reply: {"schema": {"type": "object"} if "json" in endpoint.reply
                                    else {"type": "string"}}}
    else:
        content = {"application/json": {"schema": _schema(endpoint.reply, ref)}}
    if endpoint.chunk is not None:
        content["text/event-stream"] = {"schema": _event_schema(_schema(endpoint.chunk, ref),
                                                                ref[protocol.ErrorResponse])}
    responses = {"200": {"description": "OK", "content": content}}
    for status in endpoint.errors:
        if status == 401 and not with_api_key:
            continue
        responses[str(status)] = {"description": _ERRORS[status],
                                  "content": {"application/json": {"schema": ref[protocol.ErrorResponse]}}}
    operation = {"summary": endpoint.summary, "responses": responses}
    if "{model}" in endpoint.path:
        operation["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    if endpoint.body is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": _schema(endpoint.body, ref)}}}
    if endpoint.open and with_api_key:
        operation["security"] = []
    return operation


def _schema(models: Models, ref: dict) -> dict:
    schemas = [ref[m] for m in _models(models)]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _event_schema(chunk: dict, error: dict) -> dict:
    """One server-sent event (OpenAPI 3.1 reads a stream's schema as that of each event): a JSON
    chunk, an error once streaming has begun, and `[DONE]` last."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}
