"""vLLM's `POST /tokenize` and `POST /detokenize`: token ids of a prompt or a conversation (as the
chat endpoint would build it), and the text of token ids."""

from __future__ import annotations

from aiohttp import web

from jaxserve.errors import InvalidRequestError
from jaxserve.server.openai_api import chat_prompt
from jaxserve.server.openai_protocol import (
    ChatCompletionRequest, DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from jaxserve.server.serving import CONTEXT, json_response, parse_body
from jaxserve.server.tool_calls import conversation


async def tokenize(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    body = await parse_body(request, TokenizeRequest)
    context.check_model(body.model)
    engine = context.engine.loaded()
    tokenizer = engine.tokenizer
    if body.messages is not None:
        messages, tools = conversation(ChatCompletionRequest(messages=body.messages), tokenizer.chat_template, None)
        tokens = chat_prompt(tokenizer, messages, tools, body.add_generation_prompt)
        if body.add_special_tokens:
            tokens = tokenizer.build_inputs_with_special_tokens(tokens)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = tokenizer.encode(body.prompt, add_special_tokens=add_special)
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return json_response(TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens,
                                          token_strs=strs))


async def detokenize(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    body = await parse_body(request, DetokenizeRequest)
    context.check_model(body.model)
    engine = context.engine.loaded()
    vocab = engine.model.config.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise InvalidRequestError("tokens", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return json_response(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)))
