"""The HTTP server: `create_app` wires the endpoints, errors, API key and metrics around an engine.

The engine runs in its own thread (`AsyncEngine`); the app starts it with the server and drains it
on shutdown. Serve an app with `start_server`, which turns on handler cancellation: a client that
disconnects cancels its handler, and that aborts its requests.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time

from aiohttp import web

from jaxserve.engine.async_engine import (
    AsyncEngine, EngineState, EngineUnavailableError, QueueFullError, RequestFailedError)
from jaxserve.engine.engine import LLMEngine
from jaxserve.errors import InvalidRequestError
from jaxserve.server.config import ServerConfig, model_name, served_names
from jaxserve.server.errors import APIError
from jaxserve.server.generate_api import generate
from jaxserve.server.lora_api import load_lora_adapter, unload_lora_adapter
from jaxserve.server.lora_names import LoraNames
from jaxserve.server.metrics import Metrics
from jaxserve.server.openai_api import chat_completions, completions
from jaxserve.server.openai_protocol import Health, ModelCard, ModelList, Version
from jaxserve.server.openapi import ENDPOINTS, openapi_document
from jaxserve.server.serving import CONTEXT, ServerContext, failed_request, json_response
from jaxserve.server.tokenize_api import detokenize, tokenize

log = logging.getLogger(__name__)

METRICS = web.AppKey("jaxserve_metrics", Metrics)
OPENAPI = web.AppKey("jaxserve_openapi", dict)
_OPEN_PATHS = {e.path for e in ENDPOINTS if e.open}


def create_app(engine: LLMEngine | AsyncEngine, config: ServerConfig) -> web.Application:
    """An aiohttp app serving `engine` (an `LLMEngine` is wrapped in an `AsyncEngine`)."""
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    async_engine.max_queue = config.max_queue
    names = _served_names(engine, config)
    metrics = Metrics(names[0], lambda: async_engine.stats, lambda: _cache_config(async_engine))
    async_engine.observer = metrics
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_error_middleware, _auth_middleware(config.api_key)])
    app[CONTEXT] = ServerContext(async_engine, config, names, int(time.time()), LoraNames(config))
    app[METRICS] = metrics
    app[OPENAPI] = openapi_document("jaxserve", importlib.metadata.version("jaxserve"),
                                    with_api_key=config.api_key is not None,
                                    with_lora_updates=config.enable_lora_runtime_updates)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/invocations", _invocations)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/version", _version)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    if config.enable_lora_runtime_updates:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_drain_engine)
    app.on_cleanup.append(_stop_engine)
    return app


def _cache_config(engine: AsyncEngine) -> dict:
    """vLLM's cache_config_info labels, once the engine is built."""
    if engine.engine is None:
        return {}
    built = engine.engine
    return {"block_size": built.config.page_size, "cache_dtype": built.runner.kv_dtype.name,
            "enable_prefix_caching": built.config.enable_prefix_caching,
            "num_gpu_blocks": sum(a.num_usable_pages for a in built.allocators), "num_cpu_blocks": 0}


def _served_names(engine: LLMEngine | AsyncEngine, config: ServerConfig) -> tuple[str, ...]:
    if config.served_model_name:
        return served_names(config.served_model_name)
    built = engine if isinstance(engine, LLMEngine) else engine.engine
    if built is None:
        raise ValueError("served_model_name is needed when the engine is not built yet")
    return (model_name(built.config.model),)


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves `app` on host:port (0: a free port); returns the runner (`await runner.cleanup()`
    drains and stops) and the port."""
    drain = app[CONTEXT].config.drain_timeout_s
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=drain + 5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


# ---- lifecycle -------------------------------------------------------------------------------

async def _start_engine(app: web.Application) -> None:
    await app[CONTEXT].engine.start()


async def _drain_engine(app: web.Application) -> None:
    await app[CONTEXT].engine.drain(app[CONTEXT].config.drain_timeout_s)


async def _stop_engine(app: web.Application) -> None:
    await app[CONTEXT].engine.stop()


# ---- middlewares -----------------------------------------------------------------------------

@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-shaped JSON error."""
    try:
        return await handler(request)
    except APIError as error:
        return error.response()
    except InvalidRequestError as error:
        return APIError(400, str(error), error.param, "invalid_value").response()
    except (QueueFullError, EngineUnavailableError) as error:
        retry = str(request.app[CONTEXT].config.retry_after_s)
        return APIError(503, str(error), None, "unavailable", {"Retry-After": retry}).response()
    except RequestFailedError as error:
        return failed_request(error).response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return APIError(error.status, error.text or error.reason, None, error.reason.lower().replace(" ", "_"),
                        {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None).response()
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as error:  # noqa: BLE001 - a bug: log it, answer 500, keep serving
        log.exception("handler failed")
        return APIError(500, f"internal error: {type(error).__name__}", None, "internal_error").response()


def _auth_middleware(api_key: str | None):
    expected = (api_key or "").encode()

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if api_key is not None and request.path not in _OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.strip().partition(" ")
            # HTTP auth schemes are case-insensitive: "bearer KEY" is as good as "Bearer KEY"
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
                reason = "wrong API key" if header else "missing API key (send 'Authorization: Bearer KEY')"
                raise APIError(401, reason, None, "invalid_api_key",
                               {"WWW-Authenticate": 'Bearer realm="jaxserve"'})
        return await handler(request)

    return check_key


# ---- small endpoints -------------------------------------------------------------------------

async def _health(request: web.Request) -> web.Response:
    state = request.app[CONTEXT].engine.state
    if state is not EngineState.READY:
        raise EngineUnavailableError(f"the engine is {state.value}")
    return json_response(Health(status=state.value))


def _card(context: ServerContext, name: str) -> ModelCard:
    """A served name's card; an adapter's names its base model as `parent` and its path as `root`."""
    engine = context.engine.loaded()
    lora = context.lora_request(name)
    if lora is not None:
        return ModelCard(id=name, created=context.started, root=lora.lora_path, max_model_len=engine.max_model_len,
                         parent=context.loras.parents[name] or context.model_name)
    return ModelCard(id=name, created=context.started, root=model_name(engine.config.model),
                     max_model_len=engine.max_model_len)


async def _models(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    names = [*context.model_names, *context.loras.requests]
    return json_response(ModelList(data=[_card(context, name) for name in names]))


async def _model(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    return json_response(_card(context, context.check_model(request.match_info["model"])))


async def _version(request: web.Request) -> web.Response:
    return json_response(Version(version=importlib.metadata.version("jaxserve")))


async def _invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's one route: a body with `messages` is a chat completion, else a completion."""
    try:
        parsed = json.loads(await request.read())
    except ValueError:   # not JSON, not UTF-8: the completion handler answers the bad body
        parsed = None
    chat = isinstance(parsed, dict) and "messages" in parsed
    return await (chat_completions if chat else completions)(request)


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])
