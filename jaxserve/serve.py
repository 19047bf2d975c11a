"""`python -m jaxserve.serve`: the OpenAI-compatible HTTP server on one model.

Every flag is a field of `EngineConfig` or `ServerConfig` (`--max-num-seqs` is `max_num_seqs`).
The server listens at once and answers /health with 503 while the engine loads and compiles its
step shapes (a progress bar; JAX's persistent compilation cache makes the next start faster),
then prints one ready line with the URL. SIGINT/SIGTERM drain: no new requests, running ones
finish (for up to --drain-timeout-s), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import pathlib
import signal
import sys
import time
import tomllib
import typing

import jax

from jaxserve import compile_cache, distributed
from jaxserve.config import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES,
                             PIPELINE_ADVICE, EngineConfig, SpeculativeConfig, parse_mesh, parse_size)
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.host_memory import freeze_startup_heap
from jaxserve.server.config import LOG_LEVELS, ServerConfig, model_name
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS
from jaxserve.sharding import ensure_devices

log = logging.getLogger("jaxserve.serve")

FOLLOWER_TIMEOUT_S = 900   # processes wait this long for each other to load and compile

HELP = {
    "model": "a .gguf file, an HF directory or a jaxserve.convert directory; none: the embedded "
             "SmolLM2-135M-Instruct",
    "dtype": "compute dtype (and float weights' and KV cache's); auto: float32 on CPU, bfloat16 on TPU/GPU",
    "quantization": "weights: auto (the checkpoint's own: a GGUF's Q8_0/Q4_0/Q4_1 stay quantized), none "
                    "(dequantised to --dtype), int8 / fp8 (per channel) or int4 (groups of 32), quantized at load",
    "kv_cache_dtype": "KV cache pages: auto (--dtype), int8 (a scale per token and KV head) or fp8 (= fp8_e4m3, "
                      "one scale of 1); both attention backends read them",
    "max_model_len": "context length (4k = 4000, 4K = 4096); none: the model's",
    "page_size": "tokens per KV cache page",
    "gpu_memory_utilization": "share of each device's memory (TPU/GPU: its XLA limit; CPU: the host's) for the "
                              "weights, the largest step and the KV cache, which gets what is left; none: 0.9 on "
                              "TPU/GPU, unused on CPU",
    "kv_cache_memory_bytes": "KV cache size in bytes over all devices (also 8G, 512M)",
    "kv_cache_gb": "KV cache size in GiB; none: from --gpu-memory-utilization on TPU/GPU, 1 GiB on CPU",
    "num_pages": "exact KV cache size in pages (wins over the other sizes)",
    "max_num_seqs": "sequences per engine step",
    "max_num_batched_tokens": "tokens per engine step",
    "prefill_segment": "query tokens per prefill segment",
    "attention_backend": "attention kernels: xla (plain jnp), pallas (the Pallas kernels; interpreted, slowly, "
                         "on CPU), auto: pallas on TPU and GPU, xla on CPU",
    "seed": "seed of requests that give none",
    "enable_prefix_caching": "reuse cached KV pages of common prompt prefixes",
    "enable_chunked_prefill": "prefill long prompts in chunks over several steps, beside running decodes",
    "async_scheduling": "schedule and launch each step before the one before it is read back, so the device "
                        "never waits for the host's bookkeeping (steps are serial while a penalised or "
                        "structured-output request runs)",
    "compile_in_background": "start serving once the steps no other holds and the one-stream step are "
                             "compiled (a cold start of the embedded model on 2 CPU cores: 9.1 s instead of "
                             "27-31 s); the others compile while it serves, and a step takes the smallest "
                             "compiled one it fits meanwhile",
    "enforce_eager": "compile no step at start-up: each step shape compiles the first time a step needs it (ready "
                     "sooner, each new shape's first step waits for its compile; wins over --compile-in-background)",
    "speculative_config": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
                          "\"prompt_lookup_max\": N, \"prompt_lookup_min\": M, \"disable_by_batch_size\": B} "
                          "(defaults 4, 4, 1, 8; no drafts in steps of more than B sequences)",
    "enable_lora": "serve LoRA adapters (PEFT directories) beside the base model: a request's model names one",
    "max_loras": "LoRA adapters on the device at once (a step mixes at most this many)",
    "max_lora_rank": "the largest adapter rank served (device slots are padded to it)",
    "max_cpu_loras": "LoRA adapters kept in host memory, least recently used dropped first; none: --max-loras",
    "lora_modules": "adapters served from the start: name=path, or JSON {\"name\": ..., \"path\": ..., "
                    "\"base_model_name\": ...}; needs --enable-lora",
    "enable_lora_runtime_updates": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read paths "
                                   "on this host: keep them behind --api-key)",
    "scheduling_policy": "fcfs, or priority: lower 'priority' values run sooner",
    "priority_max_wait_steps": "steps a waiting request may wait before it outranks every priority",
    "mesh": "DxM devices, data x model (tensor) parallel; on a CPU host, that many host devices; none: "
            "--data-parallel-size x --tensor-parallel-size",
    "tensor_parallel_size": "devices the model is split over (the mesh's M)",
    "data_parallel_size": "copies of the model, each with its own requests and KV pool (the mesh's D)",
    "pipeline_parallel_size": "only 1: " + PIPELINE_ADVICE,
    "distributed_executor_backend": "only uni: one process drives all of a host's devices",
    "coordinator_address": "HOST:PORT of process 0 when the mesh spans several processes (hosts); "
                           "process 0 also listens on PORT+1 for the others",
    "num_processes": "processes (hosts) the mesh spans",
    "process_id": "this process's index; process 0 serves HTTP, the others follow its steps",
    "distributed_key_dir": "CURVE keys for the channel between processes (from `jaxserve keys DIR "
                           "--num-processes N`; every host needs DIR); needed with --num-processes > 1",
    "insecure_distributed": "several processes without keys: anyone who reaches PORT+1 can read the prompts "
                            "and drive the followers",
    "served_model_name": "the model name(s) clients send (several: aliases); none: the model file's name",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port)",
    "api_key": "require 'Authorization: Bearer KEY' on every endpoint but /health",
    "max_queue": "waiting sequences beyond which requests get 503 with Retry-After",
    "max_n": "most samples per request (n)",
    "max_body_bytes": "request bodies larger than this get 413",
    "drain_timeout_s": "on SIGINT/SIGTERM, seconds running requests may take to finish",
    "retry_after_s": "the Retry-After (seconds) of a 503",
    "log_level": "logging level",
    "compile_cache_dir": "JAX's persistent compilation cache; none: ~/.cache/jaxserve/xla (or under "
                         "$XDG_CACHE_HOME)",
    "max_structured_output_bytes": "largest JSON schema, regex, grammar or choice list a request may give",
    "enable_auto_tool_choice": "let the model decide to call tools (tool_choice auto); needs --tool-call-parser",
    "tool_call_parser": "how the model writes tool calls, for tool_choice auto",
}
SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",), "pipeline_parallel_size": ("-pp",)}
def _size(name: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None   # argparse shows only this kind's message
    return parse


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


TYPES = {"max_model_len": _size("max_model_len"), "kv_cache_memory_bytes": _size("kv_cache_memory_bytes"),
         "speculative_config": _speculative_config, "lora_modules": str}
NARGS = {"served_model_name": "+", "lora_modules": "+"}
CHOICES = {"dtype": DTYPES, "scheduling_policy": SCHEDULING_POLICIES, "log_level": LOG_LEVELS,
           "attention_backend": ATTENTION_BACKENDS, "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES,
           "tool_call_parser": TOOL_CALL_PARSERS}


def _add_fields(parser: argparse.ArgumentParser, config_class) -> None:
    """One flag per dataclass field, typed and defaulted as the field is."""
    group = parser.add_argument_group(config_class.__name__)
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kind = next(t for t in (typing.get_args(hints[field.name]) or (hints[field.name],)) if t is not type(None))
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        flags = ["--" + field.name.replace("_", "-"), *SHORT_FLAGS.get(field.name, ())]
        options = dict(default=default, dest=field.name, help=HELP.get(field.name, f"{config_class.__name__}."
                                                                                  f"{field.name}"))
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **options)
        else:
            group.add_argument(*flags, type=TYPES.get(field.name, kind), choices=CHOICES.get(field.name),
                               nargs=NARGS.get(field.name), **options)


def parse_args(argv: list[str] | None = None,
               prog: str = "python -m jaxserve.serve") -> tuple[EngineConfig, ServerConfig]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=pathlib.Path, default=None,
                        help="a TOML file of the fields below (e.g. configs/*.toml); flags override it")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it: "
                                                                       "the same as --model")
    _add_fields(parser, EngineConfig)
    _add_fields(parser, ServerConfig)
    config_file = parser.parse_known_args(argv)[0].config
    if config_file is not None:
        parser.set_defaults(**_read_config_file(parser, config_file))
    args = vars(parser.parse_args(argv))
    tag = args.pop("model_tag")
    if tag is not None:
        if args["model"] not in (None, parser.get_default("model"), tag):
            parser.error(f"the model is given twice, as {tag!r} and as --model {args['model']!r}: give one")
        args["model"] = tag
    try:
        engine = EngineConfig(**{f.name: args[f.name] for f in dataclasses.fields(EngineConfig)})
        server = ServerConfig(**{f.name: args[f.name] for f in dataclasses.fields(ServerConfig)})
    except ValueError as error:
        parser.error(str(error))
    if (server.lora_modules or server.enable_lora_runtime_updates) and not engine.enable_lora:
        parser.error("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
    name = server.served_model_name or model_name(engine.model)
    return engine, dataclasses.replace(server, served_model_name=name)


def _read_config_file(parser: argparse.ArgumentParser, path: pathlib.Path) -> dict:
    """Field values from a TOML file; an unknown key is an error that lists the known ones."""
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        parser.error(f"--config {path}: {error}")
    known = {f.name for c in (EngineConfig, ServerConfig) for f in dataclasses.fields(c)}
    unknown = sorted(set(values) - known)
    if unknown:
        parser.error(f"--config {path}: unknown keys {unknown}; known: {sorted(known)}")
    return values


def _prepare_devices(mesh: str) -> None:
    """A mesh larger than a CPU host's one device gets that many host devices (before JAX starts)."""
    data, model = parse_mesh(mesh)
    if ensure_devices(data * model) and jax.default_backend() == "cpu":
        log.info("mesh %s on the CPU: running on %d host devices (jax_num_cpu_devices)", mesh, data * model)


async def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serves until SIGINT/SIGTERM (or a lost follower process); returns the exit status."""
    from jaxserve.server.app import create_app, start_server

    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    lost: list[str] = []

    def lose(message: str) -> None:   # on the event loop
        log.error("%s: failing every request and exiting", message)
        lost.append(message)
        engine.fail(message)
        stop.set()

    leader = _leader(engine_config, lambda message: loop.call_soon_threadsafe(lose, message))
    engine = AsyncEngine(lambda: _build_engine(engine_config, leader, config))
    runner, port = await start_server(create_app(engine, config), config.host, config.port)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    status = await _until_ready_or_stopped(engine, stop)
    if status is None:
        print(f"jaxserve ready in {time.perf_counter() - started:.1f} s: http://{config.host}:{port}/v1 "
              f"(model {config.served_model_name!r})", flush=True)
        await stop.wait()
        if not lost:
            log.info("draining: finishing running requests (up to %.0f s)", config.drain_timeout_s)
        status = 1 if lost else 0
    await runner.cleanup()
    if leader is not None:
        leader.close()
    return status


def _leader(config: EngineConfig, on_lost) -> "distributed.Leader | None":
    """Process 0's connections to the other processes, when there are any."""
    if config.num_processes == 1:
        return None
    return distributed.Leader(distributed.control_address(config.coordinator_address),
                              config.num_processes - 1, on_lost, _keys(config))


def _keys(config: EngineConfig) -> "distributed.Keys | None":
    if config.distributed_key_dir is None:
        log.warning("--insecure-distributed: the channel between processes is neither authenticated nor "
                    "encrypted; anyone who reaches %s:%d can read the prompts and drive the followers",
                    *distributed.control_address(config.coordinator_address))
        return None
    return distributed.load_keys(config.distributed_key_dir, config.process_id, config.num_processes)


def _fingerprint(engine) -> dict[str, str]:
    runner = engine.runner
    return distributed.fingerprint(engine.config, runner.model.params, runner.buckets, runner.kv_pages.k.shape,
                                   runner.model.values_digest)


def _build_engine(config: EngineConfig, leader: "distributed.Leader | None", server: ServerConfig):
    from jaxserve.engine.engine import LLMEngine
    from jaxserve.progress import progress_bar
    from jaxserve.server.lora_names import register_static

    engine = LLMEngine(config, progress=progress_bar("compiling"), followers=leader)
    if leader is not None:
        leader.wait_for_followers(FOLLOWER_TIMEOUT_S, _fingerprint(engine))
    register_static(engine, server)   # a bad --lora-modules adapter fails the start
    freeze_startup_heap()
    return engine


def _follow(config: EngineConfig) -> int:
    """A process other than 0: builds the same engine, then replays process 0's device calls."""
    from jaxserve.engine.engine import LLMEngine

    keys = _keys(config)
    engine = LLMEngine(config)
    freeze_startup_heap()
    return distributed.follow(engine.replay, distributed.control_address(config.coordinator_address),
                              config.process_id, FOLLOWER_TIMEOUT_S, _fingerprint(engine), keys)


async def _until_ready_or_stopped(engine: AsyncEngine, stop: asyncio.Event) -> int | None:
    """None once the engine is ready; an exit status if it failed to load or we were stopped first."""
    ready = asyncio.ensure_future(engine.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not ready.done():
        ready.cancel()
        return 0
    if ready.exception() is not None:
        log.error("the engine failed to load: %s", ready.exception())
        return 1
    return None


def warn_if_open(config: ServerConfig) -> None:
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s with no --api-key: anyone who can reach this host can use the server",
                    config.host)


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.serve") -> int:
    engine_config, server_config = parse_args(argv, prog)
    logging.basicConfig(level=server_config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if server_config.log_level != "debug":
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    warn_if_open(server_config)
    if engine_config.num_processes == 1:
        _prepare_devices(engine_config.mesh)
        compile_cache.enable(server_config.compile_cache_dir)
        return asyncio.run(serve(engine_config, server_config))
    distributed.initialize(engine_config)
    compile_cache.enable(server_config.compile_cache_dir)
    if engine_config.process_id == 0:
        status = asyncio.run(serve(engine_config, server_config))
    else:
        status = _follow(engine_config)
    # Skips jax.distributed's exit barrier, which waits for every process: after a lost process it
    # would wait for ever, and an engine thread may still be stuck in that process's collective.
    sys.stdout.flush()
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
