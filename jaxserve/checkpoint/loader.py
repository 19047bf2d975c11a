"""Finds a model's weights and tokenizer wherever they are, and returns them ready for the runner.

A model is any of: nothing (the embedded SmolLM2), a `.gguf` file, a Hugging Face directory
(`config.json` + safetensors), or a directory written by `python -m jaxserve.convert`.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
from jaxserve.checkpoint.weight_maps import checkpoint_formats, map_hf_weights, split_fused
from jaxserve.config import ModelConfig
from jaxserve.models.layers import float8
from jaxserve.models.layers.linear import WeightFormat
from jaxserve.models.llama import abstract_model, expert_shapes, linear_shapes
from jaxserve.quantization import AT_LOAD, check_quantization
from jaxserve.sharding import head_layout, pad_heads, place, sharding_for
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
    formats: dict[str, WeightFormat] = dataclasses.field(default_factory=dict)  # quantized weights
    values_digest: str = ""   # on a mesh: a digest of a sample of every weight's values (sampled_digest)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights on the devices (one copy; replicas over `data` not counted)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.params))


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


def open_gguf(path: Path):
    """A `.gguf` file's metadata and tensor index read (0.7-0.8 s for the embedded model), to give
    to both `read_checkpoint` and `load_tokenizer`; None for other formats."""
    if path.suffix != ".gguf":
        return None
    from jaxserve.checkpoint.gguf import GGUFFile

    return GGUFFile(path)


def read_checkpoint(path: Path, native: bool = False,
                    gguf_file=None) -> tuple[dict[str, Any], Any, dict[str, WeightFormat]]:
    """(HF config dict, iterator of (HF name, numpy tensor or QuantizedTensor), the formats of the
    weights that stay quantized) for a GGUF file or an HF directory. With `native`, quantized
    tensors the engine computes with stay quantized. `gguf_file`: the GGUF file read already."""
    if path.suffix == ".gguf":
        from jaxserve.checkpoint.gguf import load_gguf

        checkpoint = load_gguf(gguf_file or path, native=native)
        tensors = list(split_fused(checkpoint.tensors.items(), ModelConfig.from_hf(checkpoint.config)))
        return checkpoint.config, tensors, checkpoint_formats(tensors)
    from jaxserve.checkpoint.hf import iter_safetensors, read_hf_config
    from jaxserve.checkpoint.hf_quantized import quantized_tensors, read_scheme

    hf_config = read_hf_config(path)
    scheme = read_scheme(hf_config)
    config = ModelConfig.from_hf(hf_config)
    if scheme is None:
        return hf_config, split_fused(iter_safetensors(path), config), {}
    tensors = list(split_fused(quantized_tensors(iter_safetensors(path), scheme), config))
    return hf_config, tensors, checkpoint_formats(tensors)


def expected_params(state: nnx.State) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    return {tuple(str(k) for k in path): var.get_value() for path, var in nnx.to_flat_state(state)}


def with_values(state: nnx.State, values: dict[tuple[str, ...], Any]) -> nnx.State:
    """The abstract state with every leaf replaced by its loaded array."""
    return nnx.from_flat_state([(path, var.replace(values[tuple(str(k) for k in path)]))
                                for path, var in nnx.to_flat_state(state)])


def weight_formats(quantization: str, config: ModelConfig, native: dict[str, WeightFormat]) -> dict[str, WeightFormat]:
    """Which weights are quantized, and how: path -> format (see `jaxserve.quantization`);
    `native` are the checkpoint's own formats, which `auto` keeps."""
    shapes = linear_shapes(config) | expert_shapes(config)
    if quantization in AT_LOAD:
        formats = {p: AT_LOAD[quantization] for p in shapes if p.startswith("layers/")}
        for p, fmt in formats.items():
            fmt.check(p, shapes[p][0])
        return formats
    if quantization == "none":
        return {}
    formats = {}
    for p, fmt in native.items():
        try:
            fmt.check(p, shapes[p][0])
            formats[p] = fmt
        except ValueError as error:
            log.info("%s; dequantised at load", error)
    return formats


def load_model(model: str | None, dtype_name: str = "auto", mesh: Mesh | None = None,
               quantization: str = "auto") -> LoadedModel:
    """Loads config, weights and tokenizer. Weights go to the default device, or with a mesh shard
    by shard onto it (heads rearranged first if they do not split over its `model` axis).
    `quantization` is `--quantization` (see `jaxserve.quantization`)."""
    check_quantization(quantization)
    path = resolve_model_path(model)
    dtype = resolve_dtype(dtype_name)
    gguf_file = open_gguf(path)   # read once, for the weights and the tokenizer
    if orbax.is_converted(path):
        from jaxserve.checkpoint.hf import read_hf_config

        hf_config = read_hf_config(path)
        config = ModelConfig.from_hf(hf_config)
        formats = orbax.read_formats(path)
        if quantization not in ("auto", orbax.quantization_of(formats)):
            raise ValueError(f"{path} was converted with quantization={orbax.quantization_of(formats)!r}; "
                             f"it loads with quantization='auto' or that, not {quantization!r}")
        graphdef, abstract = abstract_model(config, dtype, formats, mesh)
        expected = expected_params(abstract)
        if mesh is not None and not needs_rearranging(config, mesh):
            expected = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding_for(mesh, "/".join(p), s.shape))
                        for p, s in expected.items()}   # restored straight into the shards
        values = orbax.restore_params(path, expected)
    else:
        hf_config, tensors, native = read_checkpoint(path, quantization == "auto", gguf_file)
        config = ModelConfig.from_hf(hf_config)
        formats = weight_formats(quantization, config, native)
        graphdef, abstract = abstract_model(config, dtype, formats, mesh)
        shapes = {p: s.shape for p, s in expected_params(abstract).items()}
        values = map_hf_weights(tensors, shapes, dtype, formats)   # host arrays
    digest = ""
    if mesh is not None:
        config, graphdef, abstract, values, digest = _onto_mesh(config, dtype, formats, values, mesh)
    else:
        values = {p: jnp.asarray(v) for p, v in values.items()}
    params = float8.as_stored(with_values(abstract, values))   # fp8 as bytes on a CPU
    loaded = LoadedModel(config, hf_config, graphdef, params, load_tokenizer(path, gguf_file), path, dtype, mesh,
                         formats, digest)
    log.info("loaded %s: %d layers, %s, %s; %.1f MiB of weights on the device", path, config.num_layers,
             jnp.dtype(dtype).name, _describe(formats), loaded.weight_bytes / 2**20)
    return loaded


def _describe(formats: dict[str, WeightFormat]) -> str:
    if not formats:
        return "no quantized weights"
    names = sorted({f.name for f in formats.values()})
    return f"{len(formats)} quantized weights ({', '.join(names)})"


def needs_rearranging(config: ModelConfig, mesh: Mesh) -> bool:
    return not head_layout(config, mesh.shape["model"]).unchanged


def _onto_mesh(config: ModelConfig, dtype, formats: dict[str, WeightFormat], values: dict, mesh: Mesh):
    """Rearranges heads for the mesh and places every weight shard by shard. Returns the weights'
    `sampled_digest` too."""
    if needs_rearranging(config, mesh):
        host = {p: np.asarray(v) for p, v in values.items()}
        config, values = pad_heads(config, host, mesh.shape["model"])
    graphdef, abstract = abstract_model(config, dtype, formats, mesh)
    placed = {p: v if isinstance(v, jax.Array) and isinstance(v.sharding, NamedSharding)  # orbax put it there
              else place(np.asarray(v), sharding_for(mesh, "/".join(p), v.shape))
              for p, v in values.items()}
    return config, graphdef, abstract, placed, sampled_digest(values)


def sampled_digest(values: dict) -> str:
    """A digest of at most 8 evenly spaced values along each axis of every host weight. Several
    processes compare it (`distributed.fingerprint`): `sharding.place` does not check that they
    loaded the same values, and this sample tells two checkpoints apart for the cost of reading
    a few thousand values. Arrays orbax restored straight into their shards are left out."""
    digest = hashlib.sha256()
    for path in sorted(values):
        value = values[path]
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            continue
        value = np.asarray(value)
        sample = value[tuple(slice(None, None, max(1, -(-n // 8))) for n in value.shape)]
        digest.update("/".join(path).encode() + np.ascontiguousarray(sample).tobytes())
    return digest.hexdigest()[:16]
