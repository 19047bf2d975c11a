"""Read Hugging Face checkpoints: `config.json` and safetensors weights as NumPy arrays."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors import safe_open

# safetensors dtypes NumPy has no native type for; read raw and view through ml_dtypes.
_ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def read_hf_config(model_dir: str | Path) -> dict:
    """Return the parsed `config.json` of a Hugging Face model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return json.loads(path.read_text())


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """Return the weight files of `model_dir`: the single file, the indexed shards, or every `*.safetensors`."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights in {model_dir}: looked for model.safetensors, "
            "model.safetensors.index.json and *.safetensors"
        )
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF tensor name, array) for every tensor in the model's safetensors files."""
    for path in safetensors_files(model_dir):
        header, data_start = _read_header(path)
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                entry = header[name]
                if entry["dtype"] in _ML_DTYPES:
                    yield name, _read_raw(path, data_start, entry)
                else:
                    yield name, f.get_tensor(name)


def _read_header(path: Path) -> tuple[dict, int]:
    """Return the JSON header of a safetensors file and the byte offset where its data begins."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def _read_raw(path: Path, data_start: int, entry: dict) -> np.ndarray:
    """Read one tensor's bytes and view them with its ml_dtypes type."""
    dtype = np.dtype(_ML_DTYPES[entry["dtype"]])
    begin, end = entry["data_offsets"]
    raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
    return raw.view(dtype).reshape(entry["shape"])
