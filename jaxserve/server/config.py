"""The server's own settings (the engine's are `jaxserve.config.EngineConfig`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | tuple[str, ...] | None = None  # the name(s) clients pass as `model` (several:
                                          # aliases; replies carry the one asked for); default: the model file's
    host: str = "127.0.0.1"
    port: int = 8000                      # 0: any free port
    api_key: str | None = None            # if set, every endpoint but /health wants `Authorization: Bearer KEY`
    max_queue: int = 256                  # waiting sequences beyond which new requests get 503
    max_n: int = 8                        # most samples per request
    max_body_bytes: int = 1 << 20         # larger request bodies get 413
    drain_timeout_s: float = 30.0         # on shutdown, how long running requests may finish
    retry_after_s: int = 1                # the Retry-After of a 503
    log_level: str = "info"
    compile_cache_dir: str | None = None  # JAX's persistent cache; None: jaxserve.compile_cache.default_dir()
    enable_auto_tool_choice: bool = False # let the model choose to call tools (tool_choice "auto")
    tool_call_parser: str | None = None   # how the model writes calls: hermes, llama3_json
    lora_modules: tuple[str, ...] | None = None   # LoRA adapters served from the start: name=path, or
                                          # JSON {"name", "path", "base_model_name"} (needs --enable-lora)
    enable_lora_runtime_updates: bool = False   # POST /v1/load_lora_adapter and /v1/unload_lora_adapter

    def __post_init__(self):
        if isinstance(self.served_model_name, (list, tuple)):
            names = tuple(self.served_model_name)
            _require(len(names) >= 1 and all(names), f"served_model_name={names} needs non-empty names")
            object.__setattr__(self, "served_model_name", names[0] if len(names) == 1 else names)
        _require(0 <= self.port < 65536, f"port={self.port} must be in [0, 65535]")
        _require(self.max_queue >= 1, f"max_queue={self.max_queue} must be >= 1")
        _require(self.max_n >= 1, f"max_n={self.max_n} must be >= 1")
        _require(self.max_body_bytes >= 1024, f"max_body_bytes={self.max_body_bytes} must be >= 1024")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        _require(self.retry_after_s >= 0, f"retry_after_s={self.retry_after_s} must be >= 0")
        _require(self.log_level in LOG_LEVELS, f"log_level={self.log_level!r} is not one of {LOG_LEVELS}")
        _require(self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
                 f"tool_call_parser={self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}")
        if self.lora_modules is not None:
            modules = tuple(self.lora_modules)
            object.__setattr__(self, "lora_modules", modules)
            names = [lora_module(m).name for m in modules]
            _require(len(set(names)) == len(names), f"lora_modules={list(modules)} names an adapter twice")
        _require(not self.enable_auto_tool_choice or self.tool_call_parser is not None,
                 "enable_auto_tool_choice needs a tool_call_parser (one of " + ", ".join(TOOL_CALL_PARSERS) + ")")


def served_names(name: str | tuple[str, ...]) -> tuple[str, ...]:
    return (name,) if isinstance(name, str) else tuple(name)


def model_name(model: str | None) -> str:
    """The default served name of a model path (the embedded model when None)."""
    if model is None:
        from jaxserve.checkpoint.default_model import GGUF_IN_PACKAGE

        model = GGUF_IN_PACKAGE
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One of --lora-modules: an adapter served under `name` as a child of `base_model_name`."""

    name: str
    path: str
    base_model_name: str | None = None   # None: the served model


def lora_module(text: str) -> LoraModule:
    """vLLM's two forms: `name=path`, or a JSON object {"name", "path", "base_model_name"}."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
            module = LoraModule(**fields)
        except (ValueError, TypeError) as error:
            raise ValueError(f"lora_modules entry {text!r}: {error}; want {{\"name\": ..., \"path\": ..., "
                             f"\"base_model_name\": ...}}") from None
    else:
        name, _, path = text.partition("=")
        module = LoraModule(name.strip(), path.strip())
    _require(bool(module.name) and bool(module.path) and all(isinstance(v, str) for v in (module.name, module.path)),
             f"lora_modules entry {text!r} needs a name and a path (name=path)")
    return module
