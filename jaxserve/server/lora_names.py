"""The LoRA adapters a server serves by name: a request's `model` names the adapter it runs with.

`--lora-modules` adapters are known from the start; the runtime endpoints (`lora_api`) add and
remove others. Each load gets a new `lora_int_id`, so an adapter reloaded under the same name never
reads the prefix-cache pages of the one before.
"""

from __future__ import annotations

import itertools

from jaxserve.engine.engine import LLMEngine
from jaxserve.lora_request import LoRARequest
from jaxserve.server.config import LoraModule, ServerConfig, lora_module


class LoraNames:
    """The served adapters by name (the event loop's view; the engine keeps their weights)."""

    def __init__(self, config: ServerConfig):
        self._ids = itertools.count(1)
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str | None] = {}   # adapter name -> its base model's served name (None: the first)
        self.pending: set[str] = set()              # names being loaded now
        for module in static_modules(config):
            self.serve(self.new(module.name, module.path), module.base_model_name)

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for a new load of an adapter: an id never given before."""
        return LoRARequest(name, next(self._ids), path)

    def serve(self, request: LoRARequest, parent: str | None = None) -> None:
        self.requests[request.lora_name] = request
        self.parents[request.lora_name] = parent

    def remove(self, name: str) -> None:
        del self.requests[name]
        del self.parents[name]


def static_modules(config: ServerConfig) -> list[LoraModule]:
    return [lora_module(m) for m in config.lora_modules or ()]


def register_static(engine: LLMEngine, config: ServerConfig) -> None:
    """Reads and checks --lora-modules at start-up (with the ids `LoraNames` gives them), so that a
    bad adapter stops the server before it listens for requests."""
    for request in LoraNames(config).requests.values():
        engine.add_lora(request)
