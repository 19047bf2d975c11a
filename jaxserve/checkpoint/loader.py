"""Finds a model's weights and tokenizer wherever they are, and returns them ready for the runner.

A model is any of: nothing (the embedded SmolLM2), a `.gguf` file, a Hugging Face directory
(`config.json` + safetensors), or a directory written by `python -m jaxserve.convert`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxserve.checkpoint import orbax
from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.weight_maps import map_hf_weights
from jaxserve.config import ModelConfig
from jaxserve.models.llama import abstract_model
from jaxserve.sharding import head_layout, pad_heads, sharding_for
from jaxserve.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    hf_config: dict[str, Any]
    graphdef: nnx.GraphDef
    params: nnx.State       # jax arrays, the model's weights
    tokenizer: Any          # a transformers fast tokenizer
    path: Path
    dtype: Any
    mesh: Mesh | None = None  # where params live, split by jaxserve.sharding's rules; None: one device


def resolve_dtype(name: str):
    """`auto` is float32 on CPU and bfloat16 on TPU/GPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return jnp.dtype(name)


def resolve_model_path(model: str | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {str(path)!r} does not exist (give a .gguf file, an HF "
                                "directory or a jaxserve.convert directory)")
    return path


def read_checkpoint(path: Path) -> tuple[dict[str, Any], Any]:
    """(HF config dict, iterator of (HF name, numpy tensor)) for a GGUF file or an HF directory."""
    if path.suffix == ".gguf":
        from jaxserve.checkpoint.gguf import load_gguf

        checkpoint = load_gguf(path)
        return checkpoint.config, list(checkpoint.tensors.items())
    from jaxserve.checkpoint.hf import iter_safetensors, read_hf_config

    return read_hf_config(path), iter_safetensors(path)


def expected_params(state: nnx.State) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    return {tuple(str(k) for k in path): var.get_value() for path, var in nnx.to_flat_state(state)}


def with_values(state: nnx.State, values: dict[tuple[str, ...], Any]) -> nnx.State:
    """The abstract state with every leaf replaced by its loaded array."""
    return nnx.from_flat_state([(path, var.replace(values[tuple(str(k) for k in path)]))
                                for path, var in nnx.to_flat_state(state)])


def load_model(model: str | None, dtype_name: str = "auto", mesh: Mesh | None = None) -> LoadedModel:
    """Loads config, weights and tokenizer. Weights go to the default device, or with a mesh shard
    by shard onto it (heads rearranged first if they do not split over its `model` axis)."""
    path = resolve_model_path(model)
    dtype = resolve_dtype(dtype_name)
    if orbax.is_converted(path):
        from jaxserve.checkpoint.hf import read_hf_config

        hf_config = read_hf_config(path)
        config = ModelConfig.from_hf(hf_config)
        graphdef, abstract = abstract_model(config, dtype)
        expected = expected_params(abstract)
        if mesh is not None and not needs_rearranging(config, mesh):
            expected = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_for(mesh, "/".join(p), s.shape))
                        for p, s in expected.items()}   # restored straight into the shards
        values = orbax.restore_params(path, expected)
    else:
        hf_config, tensors = read_checkpoint(path)
        config = ModelConfig.from_hf(hf_config)
        graphdef, abstract = abstract_model(config, dtype)
        shapes = {p: s.shape for p, s in expected_params(abstract).items()}
        values = map_hf_weights(tensors, shapes, dtype)   # host arrays
    if mesh is not None:
        config, graphdef, abstract, values = _onto_mesh(config, dtype, values, mesh)
    else:
        values = {p: jnp.asarray(v, dtype) for p, v in values.items()}
    params = with_values(abstract, values)
    log.info("loaded %s: %d layers, %.1fM parameters, %s", path, config.num_layers,
             sum(x.size for x in jax.tree.leaves(params)) / 1e6, jnp.dtype(dtype).name)
    return LoadedModel(config, hf_config, graphdef, params, load_tokenizer(path), path, dtype, mesh)


def needs_rearranging(config: ModelConfig, mesh: Mesh) -> bool:
    return not head_layout(config, mesh.shape["model"]).unchanged


def _onto_mesh(config: ModelConfig, dtype, values: dict, mesh: Mesh):
    """Rearranges heads for the mesh and places every weight shard by shard."""
    if needs_rearranging(config, mesh):
        host = {p: np.asarray(v) for p, v in values.items()}
        config, values = pad_heads(config, host, mesh.shape["model"])
    graphdef, abstract = abstract_model(config, dtype)
    placed = {p: v if isinstance(v, jax.Array) and isinstance(v.sharding, NamedSharding)  # orbax put it there
              else jax.device_put(np.asarray(v, dtype), sharding_for(mesh, "/".join(p), v.shape))
              for p, v in values.items()}
    return config, graphdef, abstract, placed
