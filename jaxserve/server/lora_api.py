"""vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (with
`--enable-lora-runtime-updates`: they read paths on the server). The engine reads and checks the
weights on its own thread (`AsyncEngine.call`); a bad adapter is a 400 naming it and what is wrong.
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.server.errors import APIError
from jaxserve.server.openai_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxserve.server.serving import CONTEXT, parse_body


async def load_lora_adapter(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    body = await parse_body(request, LoadLoRAAdapterRequest)
    names, name = context.loras, body.lora_name
    if name in names.requests or name in names.pending or name in context.model_names:
        raise APIError(400, f"lora_name={name!r} is already served; unload it first", "lora_name", "invalid_value")
    names.pending.add(name)
    try:
        lora = names.new(name, body.lora_path)
        await context.engine.call(lambda engine: engine.add_lora(lora))
        names.serve(lora)
    finally:
        names.pending.discard(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    context = request.app[CONTEXT]
    body = await parse_body(request, UnloadLoRAAdapterRequest)
    lora = context.loras.requests.get(body.lora_name)
    if lora is None:
        raise APIError(404, f"LoRA adapter {body.lora_name!r} is not loaded; loaded: "
                            f"{sorted(context.loras.requests)}", "lora_name", "model_not_found")
    await context.engine.call(lambda engine: engine.remove_lora(lora.lora_int_id))
    context.loras.remove(body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
