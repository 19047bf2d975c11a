"""What every generation endpoint does: parse the body, admit its requests, collect or stream them.

A request's streams are closed (their requests aborted) whenever the handler leaves early: a
client that disconnects cancels its handler (the server runs with handler cancellation), and a
failed write raises out of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence

from aiohttp import web
from pydantic import BaseModel, ValidationError

from jaxserve.engine.async_engine import AsyncEngine, RequestFailedError, RequestStream
from jaxserve.engine.beam_search import Beam, BeamSearch, BeamSearchParams, candidates, check_length, round_params
from jaxserve.engine.output import RequestOutput, TokenLogprob
from jaxserve.errors import InvalidRequestError
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.errors import APIError, validation_error
from jaxserve.server.lora_names import LoraNames
from jaxserve.server.openai_protocol import PromptTokensDetails, SamplingFields, Usage

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerContext:
    """What the handlers share; stored in the app under `CONTEXT`."""

    engine: AsyncEngine
    config: ServerConfig
    model_names: tuple[str, ...]  # the served name and its aliases; the first is the one metrics carry
    started: int                  # Unix time the app was made (the model's `created`)
    loras: LoraNames              # the LoRA adapters served, by name

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name (or LoRA adapter) a request asked for (the first name when it names none);
        404 for a name not served."""
        if model is not None and model not in self.model_names and model not in self.loras.requests:
            served = ", ".join(map(repr, [*self.model_names, *self.loras.requests]))
            raise APIError(404, f"model={model!r} is not served here; served: {served}", "model", "model_not_found")
        return model or self.model_name

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a checked model name runs with (None: the base model)."""
        return self.loras.requests.get(model)

    async def sampling_params(self, body: SamplingFields, max_tokens: int | None) -> SamplingParams:
        """The body's sampling parameters, checked against --max-n and the model's vocabulary, its
        structured-output constraint compiled (off the event loop and the engine thread; the
        engine then finds it cached)."""
        max_n = self.config.max_n
        n = body.n or 1
        if n > max_n:
            raise InvalidRequestError("n", f"n={n} is out of range: must be in [1, {max_n}] (--max-n)")
        params = body.sampling_params(max_tokens, self.engine.loaded().model.config.vocab_size)
        if params.best_of is not None and params.best_of > max_n:
            raise InvalidRequestError("best_of", f"best_of={params.best_of} is out of range: must be in "
                                                 f"[n={n}, {max_n}] (--max-n)")
        if params.structured_outputs is not None:
            grammars = self.engine.loaded().grammars
            try:
                await asyncio.get_running_loop().run_in_executor(None, grammars.grammar, params.structured_outputs)
            except InvalidRequestError as error:
                raise InvalidRequestError(body.constraint_field(), str(error)) from None
        return params


CONTEXT = web.AppKey("jaxserve_context", ServerContext)


async def parse_body(request: web.Request, model: type[SamplingFields]):
    """The JSON body validated as `model`; APIError 400 on malformed JSON or an invalid field, 415
    on a body declared as something other than JSON."""
    _check_content_type(request)
    raw = await request.read()  # raises 413 past the app's client_max_size
    try:
        body = model.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            detail = first.get("ctx", {}).get("error", first["msg"])
            raise APIError(400, f"the body is not valid JSON: {detail}", None, "invalid_json") from None
        if first["type"] == "model_type":
            raise APIError(400, "the body must be a JSON object", None, "invalid_json") from None
        raise validation_error(error, model) from None
    body.check()
    return body


def _check_content_type(request: web.Request) -> None:
    # A body declared as text or a form (curl's -d without -H) is not read as JSON, as vLLM refuses
    # it too; a body with no Content-Type at all (a bare HTTP client) is.
    if "Content-Type" not in request.headers:
        return
    kind = request.content_type
    if kind != "application/json" and not kind.endswith("+json"):
        raise APIError(415, f"Content-Type {kind!r} is not supported: send the body as application/json", None,
                       "unsupported_media_type")


async def admit(engine: AsyncEngine, prompts: Sequence[str | list[int]], params: SamplingParams,
                request_id: str, priority: int = 0, lora_request: LoRARequest | None = None) -> list[RequestStream]:
    """One engine request per prompt, admitted as a unit: all or none."""
    suffixes = [f"-{i}" for i in range(len(prompts))] if len(prompts) > 1 else [""]
    return await engine.add_requests(prompts, params, [request_id + s for s in suffixes], priority, lora_request)


def failed_request(error: RequestFailedError) -> APIError:
    """400 when the request caused it (naming the field), else 500."""
    if error.param is not None:
        return APIError(400, str(error), error.param, "invalid_request_error")
    return APIError(500, str(error), None, "engine_error")


async def beam_search(engine: AsyncEngine, prompt: list[int], params: BeamSearchParams, request_id: str,
                      priority: int = 0, lora_request: LoRARequest | None = None) -> list[Beam]:
    """One prompt's beam search: a round of one-token requests per token, one per live beam."""
    loaded = engine.loaded()
    check_length(len(prompt), params, loaded.max_model_len)
    search = BeamSearch(params, loaded.eos_token_ids)
    for step in itertools.count():
        if search.done:
            return search.best()
        streams = await admit(engine, [prompt + list(beam.tokens) for beam in search.live], round_params(params),
                              f"{request_id}-beam{step}", priority, lora_request)
        search.advance([candidates(output) for output in await final_outputs(streams)])


def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Waits for every stream to finish; returns the final outputs in order."""
    finals: list[RequestOutput] = [None] * len(streams)
    async for i, output in merged(streams):
        finals[i] = output
    return finals


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams, as they come."""
    if len(streams) == 1:   # one prompt (every chat request): read it without a task per output
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            close_all(streams)
        return
    pending = {asyncio.ensure_future(anext(s, None)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                output = task.result()
                if output is not None:
                    pending[asyncio.ensure_future(anext(streams[i], None))] = i
                    yield i, output
    finally:
        for task in pending:
            task.cancel()
        close_all(streams)


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained since its previous delta."""

    choice: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None   # the new tokens' (None: not asked for)
    token_ids: list[int]                  # the new tokens


class TextDeltas:
    """Turns a stream's outputs, deltas, into per-choice pieces (choice index = prompt index * n +
    sample). A choice's piece goes out when its text grows or it finishes: tokens whose text the
    engine holds back (an incomplete character, what may begin a stop string) and their logprobs
    go out with the next piece. Counts what usage reports, and keeps each prompt's logprobs, which
    only its first delta holds."""

    def __init__(self, n: int):
        self.n = n
        self.prompt_logprobs: dict[int, list] = {}   # prompt index -> its prompt logprobs (asked for)
        self._held: dict[int, tuple[list[int], list[TokenLogprob] | None]] = {}   # choice -> not sent yet
        self._finished: set[int] = set()
        self._latest: dict[int, RequestOutput] = {}  # prompt index -> its latest delta
        self._num_output_tokens = 0

    def updates(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        """A delta for each choice whose text grew or that finished."""
        self._latest[prompt_index] = output
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        moved = []
        for sample in output.outputs:
            self._num_output_tokens += len(sample.token_ids)
            choice = prompt_index * self.n + sample.index
            if choice in self._finished:
                continue
            token_ids, logprobs = sample.token_ids, sample.logprobs
            if choice in self._held:
                held_ids, held_logprobs = self._held.pop(choice)
                token_ids = held_ids + token_ids
                logprobs = None if logprobs is None else held_logprobs + logprobs
            if sample.text or sample.finish_reason:
                moved.append(ChoiceDelta(choice, sample.text, sample.finish_reason, logprobs, token_ids))
                if sample.finish_reason:
                    self._finished.add(choice)
            elif token_ids:
                self._held[choice] = token_ids, logprobs
        return moved

    def usage(self) -> Usage:
        """The tokens of every prompt seen and of every sample so far."""
        outputs = self._latest.values()
        return _usage(sum(len(o.prompt_token_ids) for o in outputs), self._num_output_tokens,
                      sum(o.num_cached_tokens or 0 for o in outputs))


def json_response(model: BaseModel) -> web.Response:
    return web.Response(text=model.model_dump_json(), content_type="application/json")


def usage(outputs: Sequence[RequestOutput]) -> Usage:
    """Of final outputs."""
    return _usage(sum(len(o.prompt_token_ids) for o in outputs),
                  sum(len(c.token_ids) for o in outputs for c in o.outputs),
                  sum(o.num_cached_tokens or 0 for o in outputs))


def _usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class EventStream:
    """A `text/event-stream` reply: `data: {json}` events, closed by `data: [DONE]`."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})

    async def __aenter__(self) -> "EventStream":
        await self.response.prepare(self.request)
        return self

    async def send(self, payload: BaseModel | dict) -> None:
        text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
        await self.response.write(f"data: {text}\n\n".encode())

    async def __aexit__(self, error_type, error, traceback) -> bool:
        if isinstance(error, (ConnectionError, asyncio.CancelledError)):
            return False  # the client is gone: nothing more to write
        with contextlib.suppress(ConnectionError):
            if error is not None:
                await self.send({"error": _stream_error(error).info().model_dump()})
            await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()
        return isinstance(error, Exception)


def _stream_error(error: Exception) -> APIError:
    """The error event of a stream whose status line (200) has gone out already."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestFailedError):
        return failed_request(error)
    log.error("streaming handler failed", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}", None, "internal_error")
