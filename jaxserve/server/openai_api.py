"""`POST /v1/completions` and `POST /v1/chat/completions`, following OpenAI's schemas."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import jinja2
from aiohttp import web

from jaxserve.engine.async_engine import RequestStream
from jaxserve.errors import InvalidRequestError
from jaxserve.server.openai_protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatMessage, ChatStreamChoice, CompletionChoice, CompletionRequest, CompletionResponse, Delta)
from jaxserve.server.serving import (
    CONTEXT, EventStream, TextDeltas, admit, final_outputs, json_response, merged, parse_body, sampling_params,
    usage)
from jaxserve.tokenizer import chat_prompt_ids


async def completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = await parse_body(request, CompletionRequest)
    context.check_model(body.model)
    params = sampling_params(body, body.max_new_tokens(), context.config.max_n)
    head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=context.model_name)
    streams = await admit(context.engine, body.prompts(), params, head["id"])
    if body.stream:
        return await _stream_completions(request, body, streams, head, params.n)
    outputs = await final_outputs(streams)
    choices = [CompletionChoice(index=p * params.n + c.index, text=c.text, finish_reason=c.finish_reason)
               for p, output in enumerate(outputs) for c in output.outputs]
    return json_response(CompletionResponse(**head, choices=choices, usage=usage(outputs)))


async def _stream_completions(request: web.Request, body: CompletionRequest, streams: Sequence[RequestStream],
                              head: dict, n: int) -> web.StreamResponse:
    deltas, finals = TextDeltas(n), []
    async with EventStream(request) as events:
        async for p, output in merged(streams):
            for choice, text, reason in deltas.updates(p, output):
                await events.send(CompletionResponse(
                    **head, choices=[CompletionChoice(index=choice, text=text, finish_reason=reason)]))
            if output.finished:
                finals.append(output)
        if body.include_usage:
            await events.send(CompletionResponse(**head, choices=[], usage=usage(finals)))
    return events.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = await parse_body(request, ChatCompletionRequest)
    context.check_model(body.model)
    params = sampling_params(body, body.max_new_tokens(), context.config.max_n)
    prompt = chat_prompt(context.engine.loaded().tokenizer, body.messages)
    head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=context.model_name)
    streams = await admit(context.engine, [prompt], params, head["id"])
    if body.stream:
        return await _stream_chat(request, body, streams, head, params.n)
    [output] = await final_outputs(streams)
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason)
               for c in output.outputs]
    return json_response(ChatCompletionResponse(**head, choices=choices, usage=usage([output])))


async def _stream_chat(request: web.Request, body: ChatCompletionRequest, streams: Sequence[RequestStream],
                       head: dict, n: int) -> web.StreamResponse:
    deltas, finals = TextDeltas(n), []
    async with EventStream(request) as events:
        for choice in range(n):
            await events.send(ChatCompletionChunk(**head, choices=[ChatStreamChoice(
                index=choice, delta=Delta(role="assistant", content=""))]))
        async for _, output in merged(streams):
            for choice, text, reason in deltas.updates(0, output):
                await events.send(ChatCompletionChunk(**head, choices=[ChatStreamChoice(
                    index=choice, delta=Delta(content=text or None), finish_reason=reason)]))
            if output.finished:
                finals.append(output)
        if body.include_usage:
            await events.send(ChatCompletionChunk(**head, choices=[], usage=usage(finals)))
    return events.response


def chat_prompt(tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """The conversation through the tokenizer's chat template, ready for the assistant's reply."""
    # "developer" is OpenAI's newer name for "system"; templates know only the latter.
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in messages]
    try:
        return chat_prompt_ids(tokenizer, conversation)
    except jinja2.TemplateError as error:
        raise InvalidRequestError("messages", f"the chat template rejected the messages: {error}") from None
