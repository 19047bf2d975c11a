"""`POST /generate`: the plain API (one prompt, its samples' text and token ids)."""

from __future__ import annotations

import uuid

from aiohttp import web

from jaxserve.server.logprobs import generate_logprobs
from jaxserve.server.openai_protocol import (
    GenerateChunk, GenerateOutput, GenerateRequest, GenerateResponse, GenerateStreamOutput)
from jaxserve.server.serving import (
    CONTEXT, EventStream, TextDeltas, admit, final_outputs, json_response, merged, parse_body, usage)


async def generate(request: web.Request) -> web.StreamResponse:
    context = request.app[CONTEXT]
    body = await parse_body(request, GenerateRequest)
    params = await context.sampling_params(body, body.max_tokens)
    streams = await admit(context.engine, [body.prompt], params, f"gen-{uuid.uuid4().hex}", body.priority)
    if body.stream:
        return await _stream(request, streams, params.n)
    [output] = await final_outputs(streams)
    outputs = [GenerateOutput(index=c.index, output_text=c.text, token_ids=c.token_ids,
                              logprobs=None if c.logprobs is None else generate_logprobs(c.logprobs),
                              cumulative_logprob=c.cumulative_logprob, finish_reason=c.finish_reason)
               for c in output.outputs]
    return json_response(GenerateResponse(outputs=outputs, usage=usage([output])))


async def _stream(request: web.Request, streams, n: int) -> web.StreamResponse:
    deltas = TextDeltas(n)
    async with EventStream(request) as events:
        async for _, output in merged(streams):
            moved = deltas.updates(0, output)
            if moved:
                await events.send(GenerateChunk(outputs=[
                    GenerateStreamOutput(index=d.choice, output_text=d.text, finish_reason=d.finish_reason,
                                         logprobs=generate_logprobs(d.logprobs) if d.logprobs else None)
                    for d in moved]))
    return events.response
