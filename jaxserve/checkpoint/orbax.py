"""jaxserve's own checkpoint format: an orbax-checkpoint tree of parameters beside HF config files.

Layout of a converted directory:
  jaxserve.json      {"format": "jaxserve-orbax", "version": 2, "dtype": ..., "quantization": ...,
                     "weight_formats": {path: WeightFormat fields}} (quantized weights' formats)
  config.json        the model's HF-style config
  tokenizer files    written by the tokenizer's `save_pretrained`
  params/            orbax StandardCheckpointer tree: {"embed": ..., "layers/q_proj": ..., ...}; a
                     quantized weight's parts under "layers/q_proj/value", ".../scale", ...
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxserve.models.layers.linear import WeightFormat

MARKER = "jaxserve.json"
FORMAT = "jaxserve-orbax"
VERSION = 2   # 2: 4-bit values packed by pairs of rows; 1 packed them by halves


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def quantization_of(formats: dict[str, WeightFormat]) -> str:
    """The `--quantization` value that gives these formats: 'none', or the formats' names."""
    return ",".join(sorted({f.name for f in formats.values()})) or "none"


def read_formats(model_dir: Path) -> dict[str, WeightFormat]:
    marker = json.loads((Path(model_dir) / MARKER).read_text())
    return {path: WeightFormat(**fields) for path, fields in marker.get("weight_formats", {}).items()}


def save_params(out_dir: Path, flat_params: dict[tuple[str, ...], np.ndarray], dtype: str,
                formats: dict[str, WeightFormat] | None = None) -> None:
    """Writes the parameters (flat path -> array) and the format marker."""
    import orbax.checkpoint as ocp

    tree = {"/".join(path): value for path, value in flat_params.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((out_dir / "params").absolute(), tree)
    formats = formats or {}
    marker = {"format": FORMAT, "version": VERSION, "dtype": dtype, "quantization": quantization_of(formats),
              "weight_formats": {path: fmt.to_json() for path, fmt in sorted(formats.items())}}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def restore_params(model_dir: Path, expected: dict[tuple[str, ...], jax.ShapeDtypeStruct]
                   ) -> dict[tuple[str, ...], jax.Array]:
    """Restores straight into the expected shapes, dtypes and shardings."""
    import orbax.checkpoint as ocp

    marker = json.loads((model_dir / MARKER).read_text())
    if marker.get("format") != FORMAT or marker.get("version") not in (1, VERSION):
        raise ValueError(f"{model_dir / MARKER} describes {marker}, expected format {FORMAT!r} version 1 or "
                         f"{VERSION}")
    if marker["version"] == 1 and "uint4" in {f["kind"] for f in marker.get("weight_formats", {}).values()}:
        raise ValueError(f"{model_dir} holds 4-bit weights packed as version 1 had them, by halves of each "
                         f"weight's rows; this jaxserve packs them by pairs: convert the source checkpoint "
                         f"again with `jaxserve convert`")
    target = {"/".join(path): spec for path, spec in expected.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore((model_dir / "params").absolute(), target)
    return {tuple(key.split("/")): value for key, value in restored.items()}
