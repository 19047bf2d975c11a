"""Sizing and allocating the device KV pool (layout: `jaxserve.models.layers.attention.KVPages`).

`--kv-cache-dtype`: auto (the compute dtype), fp8 / fp8_e4m3 (float8_e4m3fn, one scale of 1: half
the bytes of float16), int8 (a float32 scale per token and KV head: (head_dim + 4) / head_dim
bytes per value, 1.88x float16's tokens at head_dim 64).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.memory_budget import PoolBudget
from jaxserve.models.layers.attention import KVPages
from jaxserve.sharding import KV_POOL_SPEC


def resolve_kv_dtype(name: str, compute_dtype):
    """The pool's dtype for `--kv-cache-dtype`."""
    return {"auto": jnp.dtype(compute_dtype), "int8": jnp.dtype(jnp.int8),
            "fp8": jnp.dtype(jnp.float8_e4m3fn), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn)}[name]


def is_scaled(dtype) -> bool:
    """int8 pages carry a scale per token and KV head."""
    return jnp.dtype(dtype) == jnp.int8


def bytes_per_page(model: ModelConfig, page_size: int, dtype) -> int:
    """K and V of `page_size` tokens in every layer, their scales included."""
    per_value = model.head_dim * jnp.dtype(dtype).itemsize + (4 if is_scaled(dtype) else 0)
    return 2 * model.num_layers * page_size * model.num_kv_heads * per_value


CPU_KV_CACHE_GB = 1.0               # the pool on CPU unless a flag sizes it
GPU_MEMORY_UTILIZATION = 0.9        # vLLM's default on TPU/GPU


def sized_by_budget(config: EngineConfig, platform: str) -> bool:
    """True when no flag gives the pool's size and it comes from the device's memory: always on
    TPU/GPU, on CPU only with --gpu-memory-utilization."""
    given = (config.num_pages, config.kv_cache_memory_bytes, config.kv_cache_gb)
    return all(v is None for v in given) and (config.gpu_memory_utilization is not None or platform != "cpu")


def utilization(config: EngineConfig) -> float:
    return config.gpu_memory_utilization if config.gpu_memory_utilization is not None else GPU_MEMORY_UTILIZATION


def _pool_bytes(config: EngineConfig, budget: PoolBudget | None) -> tuple[float, str, str]:
    """(bytes, where they come from, the flag that changes them)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes, f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}", \
            "--kv-cache-memory-bytes"
    if config.kv_cache_gb is not None:
        return config.kv_cache_gb * 2**30, f"kv_cache_gb={config.kv_cache_gb:g}", "--kv-cache-gb"
    if budget is not None:
        return budget.total, f"gpu_memory_utilization={budget.utilization:g} ({budget.describe()})", \
            "--gpu-memory-utilization"
    return CPU_KV_CACHE_GB * 2**30, f"kv_cache_gb={CPU_KV_CACHE_GB:g} (the CPU default)", "--kv-cache-gb"


def num_pages(config: EngineConfig, model: ModelConfig, dtype, max_model_len: int, num_slices: int = 1,
              budget: PoolBudget | None = None, extra_bytes_per_page: int = 0,
              window: int | None = None) -> tuple[int, str]:
    """(pages per data slice, its page 0 included; where the size comes from), the pool split evenly
    between `num_slices`. `budget`: the memory left on the devices when `sized_by_budget`. Fails if
    one max-length sequence cannot fit in a slice; with `window`, every layer's, when pages behind
    it are released, one sequence holds at most a window and a step's chunk of tokens at a time.
    `extra_bytes_per_page`: a draft model's pool, page for page beside the target's, shares the bytes."""
    if config.num_pages is not None:
        total, flag = config.num_pages, "--num-pages"
        source = f"num_pages={total}"
    else:
        size, source, flag = _pool_bytes(config, budget)
        total = int(size // (bytes_per_page(model, config.page_size, dtype) + extra_bytes_per_page))
        source += f": {total} pages"
    pages = total // num_slices
    if num_slices > 1:
        source += f" split over {num_slices} data slices ({pages} pages each)"
    longest, what = max_model_len, f"one sequence of max_model_len={max_model_len}"
    if window and config.enable_chunked_prefill and window + config.max_num_batched_tokens < max_model_len:
        # the keys kept before a chunk's first query (see Scheduler._release_behind_window), the
        # chunk, and a page they start inside
        longest = window + config.max_num_batched_tokens + config.page_size - 1
        what = (f"one sequence of a sliding window of {window} and a step of "
                f"max_num_batched_tokens={config.max_num_batched_tokens}")
    needed = math.ceil(longest / config.page_size) + 1
    if pages < needed:
        raise ValueError(
            f"the KV pool is too small: {source} holds {max(pages - 1, 0) * config.page_size} tokens per slice, "
            f"but {what} needs {needed - 1} pages of {config.page_size} "
            f"tokens plus the reserved page 0 ({needed} pages, "
            f"{needed * (bytes_per_page(model, config.page_size, dtype) + extra_bytes_per_page) / 2**30:.3f} GiB); "
            f"raise {flag} "
            f"or lower --max-model-len")
    return pages, source


def num_data_slices(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["data"]


def abstract(model: ModelConfig, pages_per_slice: int, page_size: int, dtype, mesh: Mesh | None = None) -> KVPages:
    """The pool's shapes, dtypes and shardings (`ShapeDtypeStruct`s): each data slice's pages on its
    devices, KV heads split over `model`."""
    pages = pages_per_slice * num_data_slices(mesh)
    shape = (model.num_layers, model.num_kv_heads, pages, page_size, model.head_dim)

    def struct(shape, dtype):
        sharding = None if mesh is None else NamedSharding(mesh, P(*KV_POOL_SPEC[:len(shape)]))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    scales = {}
    if is_scaled(dtype):
        scales = dict(k_scale=struct(shape[:-1], jnp.float32), v_scale=struct(shape[:-1], jnp.float32))
    return KVPages(k=struct(shape, dtype), v=struct(shape, dtype), **scales)


def allocate(model: ModelConfig, pages_per_slice: int, page_size: int, dtype, mesh: Mesh | None = None) -> KVPages:
    """Zeros, created in place where `abstract` places them."""
    def zeros(struct):
        return jax.jit(lambda: jnp.zeros(struct.shape, struct.dtype), out_shardings=struct.sharding)()

    return jax.tree.map(zeros, abstract(model, pages_per_slice, page_size, dtype, mesh))
