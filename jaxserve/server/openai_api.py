"""`POST /v1/completions` and `POST /v1/chat/completions`, following OpenAI's schemas (chat's
tools: `tool_calls`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import jinja2
from aiohttp import web

from jaxserve.engine.async_engine import RequestStream
from jaxserve.engine.output import CompletionOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.server.errors import APIError
from jaxserve.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from jaxserve.server.openai_protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatStreamChoice,
    CompletionChoice, CompletionRequest, CompletionResponse, Delta)
from jaxserve.server.serving import (
    CONTEXT, ChoiceDelta, EventStream, TextDeltas, admit, final_outputs, json_response, merged, parse_body,
    usage)
from jaxserve.server.tool_calls import ToolReply, conversation
from jaxserve.tokenizer import chat_prompt_ids


async def completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = await parse_body(request, CompletionRequest)
    model = context.check_model(body.model)
    params = await context.sampling_params(body, body.max_new_tokens())
    texts = TokenTexts(context.engine.loaded().tokenizer)
    head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
    streams = await admit(context.engine, body.prompts(), params, head["id"], body.priority)
    if body.stream:
        return await _stream_completions(request, body, streams, head, params.n, texts)
    outputs = await final_outputs(streams)
    choices = [_completion_choice(p * params.n + sample.index, sample, texts)
               for p, output in enumerate(outputs) for sample in output.outputs]
    return json_response(CompletionResponse(**head, choices=choices, usage=usage(outputs)))


def _completion_choice(index: int, sample: CompletionOutput, texts: TokenTexts) -> CompletionChoice:
    logprobs = None if sample.logprobs is None else completion_logprobs(sample.logprobs, texts)
    return CompletionChoice(index=index, text=sample.text, logprobs=logprobs,
                            finish_reason=openai_finish_reason(sample.finish_reason))


async def _stream_completions(request: web.Request, body: CompletionRequest, streams: Sequence[RequestStream],
                              head: dict, n: int, texts: TokenTexts) -> web.StreamResponse:
    deltas, finals = TextDeltas(n), []
    offsets: dict[int, int] = {}   # choice -> length of the token texts sent (the next text_offset)
    async with EventStream(request) as events:
        async for p, output in merged(streams):
            for delta in deltas.updates(p, output):
                await events.send(CompletionResponse(
                    **head, choices=[_completion_delta(delta, texts, offsets)]))
            if output.finished:
                finals.append(output)
        if body.include_usage:
            await events.send(CompletionResponse(**head, choices=[], usage=usage(finals)))
    return events.response


def _completion_delta(delta: ChoiceDelta, texts: TokenTexts, offsets: dict[int, int]) -> CompletionChoice:
    logprobs = None
    if delta.logprobs:
        logprobs = completion_logprobs(delta.logprobs, texts, offsets.get(delta.choice, 0))
        offsets[delta.choice] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    return CompletionChoice(index=delta.choice, text=delta.text, logprobs=logprobs,
                            finish_reason=openai_finish_reason(delta.finish_reason))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = await parse_body(request, ChatCompletionRequest)
    model = context.check_model(body.model)
    parser = context.config.tool_call_parser
    if body.tool_mode() == "auto" and not context.config.enable_auto_tool_choice:
        raise InvalidRequestError("tool_choice", "tool_choice 'auto' (the default with tools) needs the server "
                                                 "started with --enable-auto-tool-choice and --tool-call-parser; "
                                                 "send tool_choice 'required', 'none' or a named function")
    params = await context.sampling_params(body, body.max_new_tokens())
    tokenizer = context.engine.loaded().tokenizer
    prompt = chat_prompt(tokenizer, *conversation(body, tokenizer.chat_template, parser))
    head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
    streams = await admit(context.engine, [prompt], params, head["id"], body.priority)
    texts = TokenTexts(tokenizer)
    if body.stream:
        return await _stream_chat(request, body, streams, head, params.n, texts, parser)
    [output] = await final_outputs(streams)
    reply = ToolReply(body, parser)
    choices = [ChatChoice(index=c.index, message=reply.message(c.text),
                          finish_reason=reply.finish_reason(c.text, openai_finish_reason(c.finish_reason)),
                          logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs, texts))
               for c in output.outputs]
    return json_response(ChatCompletionResponse(**head, choices=choices, usage=usage([output])))


async def _stream_chat(request: web.Request, body: ChatCompletionRequest, streams: Sequence[RequestStream],
                       head: dict, n: int, texts: TokenTexts, parser: str | None) -> web.StreamResponse:
    deltas, finals = TextDeltas(n), []
    replies = [ToolReply(body, parser) for _ in range(n)]
    held = [[] for _ in range(n)]   # per choice: logprobs of tokens whose text a tool reply holds back
    async with EventStream(request) as events:
        for choice in range(n):
            await events.send(ChatCompletionChunk(**head, choices=[ChatStreamChoice(
                index=choice, delta=Delta(role="assistant", content=""))]))
        async for _, output in merged(streams):
            for delta in deltas.updates(0, output):
                reply = replies[delta.choice]
                openai_finish_reason(delta.finish_reason)
                message = reply.delta(delta.text, delta.finish_reason is not None)
                held[delta.choice] += delta.logprobs or []
                if message is None and delta.finish_reason is None:
                    continue
                logprobs, held[delta.choice] = held[delta.choice], []
                await events.send(ChatCompletionChunk(**head, choices=[ChatStreamChoice(
                    index=delta.choice, delta=message or Delta(),
                    finish_reason=reply.finish_reason(reply.text, delta.finish_reason),
                    logprobs=chat_logprobs(logprobs, texts) if logprobs else None)]))
            if output.finished:
                finals.append(output)
        if body.include_usage:
            await events.send(ChatCompletionChunk(**head, choices=[], usage=usage(finals)))
    return events.response


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's clients know no "abort": a request the server cut short (at shutdown, past
    --drain-timeout-s) is an error instead, a 503, or in a stream an error event."""
    if reason == "abort":
        raise APIError(503, "the server is shutting down and stopped this request before it finished "
                            "(--drain-timeout-s)", None, "server_shutting_down")
    return reason


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """The conversation through the tokenizer's chat template (by default ready for the assistant's reply)."""
    try:
        return chat_prompt_ids(tokenizer, messages, tools, add_generation_prompt)
    except jinja2.TemplateError as error:
        raise InvalidRequestError("messages", f"the chat template rejected the messages: {error}") from None
