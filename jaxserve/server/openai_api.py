"""`POST /v1/completions` and `POST /v1/chat/completions`, following OpenAI's schemas (chat's
tools: `tool_calls`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

import jinja2
from aiohttp import web

from jaxserve.engine.async_engine import RequestStream
from jaxserve.engine.output import RequestOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.server.errors import APIError
from jaxserve.server.logprobs import (
    TokenTexts, chat_logprobs, completion_logprobs, echo_logprobs, joined, prompt_logprobs)
from jaxserve.server.openai_protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatStreamChoice, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Delta, Usage)
from jaxserve.server.serving import (
    CONTEXT, EventStream, TextDeltas, admit, beam_search, final_outputs, json_response, merged, parse_body,
    usage)
from jaxserve.server.tool_calls import ToolReply, conversation
from jaxserve.tokenizer import chat_prompt_ids


async def completions(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = await parse_body(request, CompletionRequest)
    model = context.check_model(body.model)
    params = await context.sampling_params(body, body.max_new_tokens())
    tokenizer = context.engine.loaded().tokenizer
    texts = TokenTexts(tokenizer, body.return_tokens_as_token_ids)
    head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
    if body.use_beam_search:
        return await _beam_completions(context, body, tokenizer, head)
    streams = await admit(context.engine, body.prompts(), params, head["id"], body.priority,
                          context.lora_request(model))
    if body.stream:
        return await _stream_completions(request, body, streams, head, params.n, texts, tokenizer)
    outputs = await final_outputs(streams)
    choices = []
    for p, output in enumerate(outputs):
        echo = _prompt_text(output, tokenizer) if body.echo else ""
        extra = {}
        if body.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs(output.prompt_logprobs, texts, body.prompt_logprobs)
        for sample in output.outputs:
            choices.append(CompletionChoice(
                index=p * params.n + sample.index, text=echo + sample.text,
                logprobs=_echoed_logprobs(body, output, output.prompt_logprobs, sample.logprobs, texts, {}, 0),
                finish_reason=openai_finish_reason(sample.finish_reason),
                **_token_ids(body, output.prompt_token_ids, sample.token_ids), **extra))
    return json_response(CompletionResponse(**head, choices=choices, usage=usage(outputs)))


def _echoed_logprobs(body: CompletionRequest, output: RequestOutput, prompt_entries, entries, texts: TokenTexts,
                     offsets: dict[int, int], choice: int, first: bool = True) -> CompletionLogprobs | None:
    """A choice's (or a streamed piece's) logprobs; under echo, its first carries the prompt's
    (`prompt_entries`) before the completion's. `offsets`: choice -> length of the token texts sent
    (the next text_offset)."""
    if body.logprobs is None:
        return None
    prompt = None
    if first and body.echo:
        prompt = echo_logprobs(output.prompt_token_ids, prompt_entries, texts, body.logprobs)
        offsets[choice] = sum(map(len, prompt.tokens))
    completion = None
    if entries:
        completion = completion_logprobs(entries, texts, offsets.get(choice, 0))
        offsets[choice] = completion.text_offset[-1] + len(completion.tokens[-1])
    return completion if prompt is None else joined(prompt, completion)


async def _beam_completions(context, body: CompletionRequest, tokenizer, head: dict) -> web.Response:
    """use_beam_search: each prompt's n best beams, best first, as its n choices."""
    prompts = [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
               for p in body.prompts()]
    params = body.beam_search_params(body.max_new_tokens())
    lora = context.lora_request(head["model"])
    searches = await asyncio.gather(*(beam_search(context.engine, prompt, params, f"{head['id']}-{p}", body.priority,
                                                  lora) for p, prompt in enumerate(prompts)))
    choices, generated = [], 0
    for p, (prompt, beams) in enumerate(zip(prompts, searches)):
        echo = tokenizer.decode(prompt) if body.echo else ""
        for i, beam in enumerate(beams):
            generated += len(beam.tokens)
            choices.append(CompletionChoice(
                index=p * params.beam_width + i, text=echo + tokenizer.decode(beam.tokens, skip_special_tokens=True),
                finish_reason="stop" if beam.finished else "length", **_token_ids(body, prompt, beam.tokens)))
    used = sum(map(len, prompts))
    return json_response(CompletionResponse(**head, choices=choices, usage=Usage(
        prompt_tokens=used, completion_tokens=generated, total_tokens=used + generated)))


def _prompt_text(output: RequestOutput, tokenizer) -> str:
    """What echo repeats: the prompt's text, decoded when it came as token ids."""
    return output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)


def _token_ids(body, prompt_token_ids: list[int] | None, token_ids: list[int]) -> dict:
    """return_token_ids's fields of a choice; the prompt's only where given (a stream's first chunk)."""
    if not body.return_token_ids:
        return {}
    return dict(token_ids=list(token_ids), **({} if prompt_token_ids is None else
                                              dict(prompt_token_ids=list(prompt_token_ids))))


async def _stream_completions(request: web.Request, body: CompletionRequest, streams: Sequence[RequestStream],
                              head: dict, n: int, texts: TokenTexts, tokenizer) -> web.StreamResponse:
    deltas = TextDeltas(n)
    offsets: dict[int, int] = {}   # choice -> length of the token texts sent (the next text_offset)
    started: set[int] = set()      # choices whose first chunk was sent (echo and prompt ids go in it)
    async with EventStream(request) as events:
        async for p, output in merged(streams):
            for delta in deltas.updates(p, output):
                first = delta.choice not in started
                started.add(delta.choice)
                choice = CompletionChoice(
                    index=delta.choice, text=(_prompt_text(output, tokenizer) if first and body.echo else "")
                    + delta.text, logprobs=_echoed_logprobs(body, output, deltas.prompt_logprobs.get(p), delta.logprobs,
                                                            texts, offsets, delta.choice, first),
                    finish_reason=openai_finish_reason(delta.finish_reason),
                    **_token_ids(body, output.prompt_token_ids if first else None, delta.token_ids))
                await events.send(CompletionResponse(**head, choices=[choice], usage=deltas.usage()
                                                     if body.continuous_usage else None))
        if body.include_usage:
            await events.send(CompletionResponse(**head, choices=[], usage=deltas.usage()))
    return events.response


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
    messages, tools = conversation(body, tokenizer.chat_template, parser)
    prompt = chat_prompt(tokenizer, messages, tools, body.add_generation_prompt is not False,
                         bool(body.continue_final_message))
    head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
    if body.use_beam_search:
        return await _beam_chat(context, body, prompt, tokenizer, head)
    streams = await admit(context.engine, [prompt], params, head["id"], body.priority, context.lora_request(model))
    texts = TokenTexts(tokenizer, body.return_tokens_as_token_ids)
    # echo: a reply that continues the assistant's last message starts with it (vLLM's)
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
    if body.stream:
        return await _stream_chat(request, body, streams, head, params.n, texts, parser, prompt, echo)
    [output] = await final_outputs(streams)
    reply = ToolReply(body, parser)
    choices = [ChatChoice(index=c.index, message=reply.message(echo + c.text),
                          finish_reason=reply.finish_reason(c.text, openai_finish_reason(c.finish_reason)),
                          logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs, texts),
                          **_token_ids(body, None, c.token_ids))
               for c in output.outputs]
    extra = {"prompt_token_ids": prompt} if body.return_token_ids else {}
    if body.prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs(output.prompt_logprobs, texts, body.prompt_logprobs)
    return json_response(ChatCompletionResponse(**head, choices=choices, usage=usage([output]), **extra))


async def _beam_chat(context, body: ChatCompletionRequest, prompt: list[int], tokenizer, head: dict) -> web.Response:
    """use_beam_search: the conversation's n best replies, best first."""
    if body.tool_mode() != "none":
        raise InvalidRequestError("tools", "tools do not combine with use_beam_search")
    room = context.engine.loaded().max_model_len - len(prompt)
    params = body.beam_search_params(body.max_new_tokens() or room)
    beams = await beam_search(context.engine, prompt, params, head["id"], body.priority,
                              context.lora_request(head["model"]))
    choices = [ChatChoice(index=i, message=AssistantMessage(content=tokenizer.decode(beam.tokens,
                                                                                     skip_special_tokens=True)),
                          finish_reason="stop" if beam.finished else "length", **_token_ids(body, None, beam.tokens))
               for i, beam in enumerate(beams)]
    generated = sum(len(beam.tokens) for beam in beams)
    extra = {"prompt_token_ids": prompt} if body.return_token_ids else {}
    return json_response(ChatCompletionResponse(**head, choices=choices, usage=Usage(
        prompt_tokens=len(prompt), completion_tokens=generated, total_tokens=len(prompt) + generated), **extra))


async def _stream_chat(request: web.Request, body: ChatCompletionRequest, streams: Sequence[RequestStream],
                       head: dict, n: int, texts: TokenTexts, parser: str | None, prompt: list[int],
                       echo: str) -> web.StreamResponse:
    deltas = TextDeltas(n)
    replies = [ToolReply(body, parser) for _ in range(n)]
    held = [([], []) for _ in range(n)]   # per choice: logprobs and ids of tokens whose text a tool reply holds
    async with EventStream(request) as events:
        for choice in range(n):
            await events.send(ChatCompletionChunk(**head, choices=[ChatStreamChoice(
                index=choice, delta=Delta(role="assistant", content=echo))],
                **({"prompt_token_ids": prompt} if body.return_token_ids and choice == 0 else {})))
        async for _, output in merged(streams):
            for delta in deltas.updates(0, output):
                reply = replies[delta.choice]
                openai_finish_reason(delta.finish_reason)
                message = reply.delta(delta.text, delta.finish_reason is not None)
                held[delta.choice][0].extend(delta.logprobs or [])
                held[delta.choice][1].extend(delta.token_ids)
                if message is None and delta.finish_reason is None:
                    continue
                (logprobs, token_ids), held[delta.choice] = held[delta.choice], ([], [])
                await events.send(ChatCompletionChunk(**head, choices=[ChatStreamChoice(
                    index=delta.choice, delta=message or Delta(),
                    finish_reason=reply.finish_reason(reply.text, delta.finish_reason),
                    logprobs=chat_logprobs(logprobs, texts) if logprobs else None,
                    **_token_ids(body, None, token_ids))],
                    usage=deltas.usage() if body.continuous_usage else None))
        if body.include_usage:
            await events.send(ChatCompletionChunk(**head, choices=[], usage=deltas.usage()))
    return events.response


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's clients know no "abort": a request the server cut short (at shutdown, past
    --drain-timeout-s) is an error instead, a 503, or in a stream an error event."""
    if reason == "abort":
        raise APIError(503, "the server is shutting down and stopped this request before it finished "
                            "(--drain-timeout-s)", None, "server_shutting_down")
    return reason


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """The conversation through the tokenizer's chat template (by default ready for the assistant's reply)."""
    try:
        return chat_prompt_ids(tokenizer, messages, tools, add_generation_prompt, continue_final_message)
    except jinja2.TemplateError as error:
        raise InvalidRequestError("messages", f"the chat template rejected the messages: {error}") from None
