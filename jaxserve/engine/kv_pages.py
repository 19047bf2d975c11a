"""Sizing and allocating the device KV pool (layout: `jaxserve.models.layers.attention.KVPages`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models.layers.attention import KVPages
from jaxserve.sharding import KV_POOL_SPEC


def bytes_per_page(model: ModelConfig, page_size: int, dtype) -> int:
    """K and V of `page_size` tokens in every layer."""
    return 2 * model.num_layers * page_size * model.num_kv_heads * model.head_dim * jnp.dtype(dtype).itemsize


def num_pages(config: EngineConfig, model: ModelConfig, dtype, max_model_len: int, num_slices: int = 1) -> int:
    """Pages per data slice (its page 0 included), the pool split evenly between `num_slices`;
    fails if one max-length sequence cannot fit in a slice."""
    if config.num_pages is not None:
        total = config.num_pages
        source = f"num_pages={total}"
    else:
        total = int(config.kv_cache_gb * 2**30 // bytes_per_page(model, config.page_size, dtype))
        source = f"kv_cache_gb={config.kv_cache_gb} ({total} pages)"
    pages = total // num_slices
    if num_slices > 1:
        source += f" split over {num_slices} data slices ({pages} pages each)"
    needed = math.ceil(max_model_len / config.page_size) + 1
    if pages < needed:
        raise ValueError(
            f"the KV pool is too small: {source} holds {max(pages - 1, 0) * config.page_size} tokens per slice, "
            f"but one sequence of max_model_len={max_model_len} needs {needed - 1} pages of {config.page_size} "
            f"tokens plus the reserved page 0 ({needed} pages, "
            f"{needed * bytes_per_page(model, config.page_size, dtype) / 2**30:.3f} GiB)")
    return pages


def num_data_slices(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["data"]


def allocate(model: ModelConfig, pages_per_slice: int, page_size: int, dtype, mesh: Mesh | None = None) -> KVPages:
    """Zeros, created in place: on the default device, or over the mesh, each data slice's pages
    on its devices and KV heads split over `model`."""
    pages = pages_per_slice * num_data_slices(mesh)
    shape = (model.num_layers, model.num_kv_heads, pages, page_size, model.head_dim)
    if mesh is None:
        return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    sharding = NamedSharding(mesh, KV_POOL_SPEC)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVPages(k=zeros(), v=zeros())
