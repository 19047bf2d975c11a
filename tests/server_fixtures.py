"""Servers for the server tests: an app on a free loopback port, its event loop in a thread.

Engines are built once per session (compiling is what costs); each test module serves them with
the server config it needs. Only one server may drive an engine at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time

import pytest
import requests

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.server.app import create_app, start_server
from jaxserve.server.config import ServerConfig
from jaxserve.server.serving import CONTEXT

TINY_ENGINE = dict(num_pages=160, max_num_seqs=8, max_num_batched_tokens=128, prefill_segment=16, max_model_len=128)
SMOLLM2_ENGINE = dict(kv_cache_gb=0.25, max_num_seqs=16, max_num_batched_tokens=128, prefill_segment=32,
                      max_model_len=512)
_in_use: set[int] = set()


class ServerThread:
    """`create_app(engine, config)` served on 127.0.0.1 by an event loop in a background thread."""

    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> "ServerThread":
        if id(self.engine) in _in_use:
            raise RuntimeError("another test server is driving this engine")
        _in_use.add(id(self.engine))
        self._thread.start()
        self.run(self._start(), timeout=60)
        return self

    async def _start(self) -> None:
        self.app = create_app(self.engine, self.config)
        self.runner, self.port = await start_server(self.app, "127.0.0.1", 0)
        await self.app[CONTEXT].engine.wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def async_engine(self):
        return self.app[CONTEXT].engine

    def run(self, coroutine, timeout: float = 60):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        try:
            self.run(self.runner.cleanup(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            _in_use.discard(id(self.engine))


@contextlib.contextmanager
def serving(engine: LLMEngine, **config):
    """A started `ServerThread` over `engine` with `ServerConfig(**config)`; stopped on exit."""
    server = ServerThread(engine, ServerConfig(**{"served_model_name": "test-model", **config})).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_engine(tiny_models):
    """An engine over a tiny random Llama (SmolLM2's tokenizer): fast steps, garbage text."""
    directory, _ = tiny_models("llama")
    return LLMEngine(EngineConfig(model=str(directory), **TINY_ENGINE))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2):
    """An engine over the embedded SmolLM2-135M-Instruct, 16 sequences per step."""
    return LLMEngine(EngineConfig(**SMOLLM2_ENGINE), model=smollm2)


def openai_client(server: ServerThread, api_key: str = "unused", timeout: float = 120):
    """The official client against a test server: no retries, so a failure shows at once."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def pool_is_full(engine: LLMEngine) -> bool:
    return engine.stats().kv_cache_usage == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_flags(config: dict) -> list[str]:
    """`jaxserve.serve` flags for config fields: {"max_num_seqs": 4, "enforce_eager": True} ->
    ["--max-num-seqs", "4", "--enforce-eager"] (False: "--no-enforce-eager")."""
    def flag(name, value):
        option = name.replace("_", "-")
        if isinstance(value, bool):
            return [f"--{option}" if value else f"--no-{option}"]
        return [f"--{option}", str(value)]
    return [part for name, value in config.items() for part in flag(name, value)]


def wait_until_healthy(url: str, server: subprocess.Popen, timeout: float = 180) -> list[int]:
    """/health statuses polled until 200 (asserting the server process stays up); returns them."""
    statuses = []
    deadline = time.monotonic() + timeout
    while not statuses or statuses[-1] != 200:
        assert server.poll() is None, "the server exited"
        assert time.monotonic() < deadline, f"not ready after {timeout} s: {statuses[-5:]}"
        try:
            statuses.append(requests.get(f"{url}/health", timeout=5).status_code)
        except requests.ConnectionError:
            pass
        time.sleep(0.05)
    return statuses
