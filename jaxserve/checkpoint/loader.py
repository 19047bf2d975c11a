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
from flax import nnx

from jaxserve.checkpoint import orbax
from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.weight_maps import map_hf_weights
from jaxserve.config import ModelConfig
from jaxserve.models.llama import abstract_model
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


def load_model(model: str | None, dtype_name: str = "auto") -> LoadedModel:
    """Loads config, weights (onto the default device) and tokenizer."""
    path = resolve_model_path(model)
    dtype = resolve_dtype(dtype_name)
    if orbax.is_converted(path):
        from jaxserve.checkpoint.hf import read_hf_config

        hf_config = read_hf_config(path)
        config = ModelConfig.from_hf(hf_config)
        graphdef, abstract = abstract_model(config, dtype)
        values = orbax.restore_params(path, expected_params(abstract))
    else:
        hf_config, tensors = read_checkpoint(path)
        config = ModelConfig.from_hf(hf_config)
        graphdef, abstract = abstract_model(config, dtype)
        shapes = {p: s.shape for p, s in expected_params(abstract).items()}
        values = {p: jnp.asarray(v, dtype) for p, v in map_hf_weights(tensors, shapes, dtype).items()}
    params = with_values(abstract, values)
    log.info("loaded %s: %d layers, %.1fM parameters, %s", path, config.num_layers,
             sum(x.size for x in jax.tree.leaves(params)) / 1e6, jnp.dtype(dtype).name)
    return LoadedModel(config, hf_config, graphdef, params, load_tokenizer(path), path, dtype)
