"""jaxserve's own checkpoint format: an orbax-checkpoint tree of parameters beside HF config files.

Layout of a converted directory:
  jaxserve.json      {"format": "jaxserve-orbax", "version": 1, "dtype": ...}
  config.json        the model's HF-style config
  tokenizer files    written by the tokenizer's `save_pretrained`
  params/            orbax StandardCheckpointer tree: {"embed": ..., "layers/q_proj": ..., ...}
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

MARKER = "jaxserve.json"
FORMAT = "jaxserve-orbax"


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_params(out_dir: Path, flat_params: dict[tuple[str, ...], np.ndarray], dtype: str) -> None:
    """Writes the parameters (flat path -> array) and the format marker."""
    import orbax.checkpoint as ocp

    tree = {"/".join(path): value for path, value in flat_params.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((out_dir / "params").absolute(), tree)
    (out_dir / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "dtype": dtype}) + "\n")


def restore_params(model_dir: Path, expected: dict[tuple[str, ...], jax.ShapeDtypeStruct]
                   ) -> dict[tuple[str, ...], jax.Array]:
    """Restores straight into the expected shapes, dtypes and shardings."""
    import orbax.checkpoint as ocp

    marker = json.loads((model_dir / MARKER).read_text())
    if marker.get("format") != FORMAT or marker.get("version") != 1:
        raise ValueError(f"{model_dir / MARKER} describes {marker}, expected format {FORMAT!r} version 1")
    target = {"/".join(path): spec for path, spec in expected.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore((model_dir / "params").absolute(), target)
    return {tuple(key.split("/")): value for key, value in restored.items()}
