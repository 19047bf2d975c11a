"""Read Hugging Face checkpoints: `config.json` and safetensors weights as NumPy arrays.

A multimodal checkpoint of `TEXT_MODELS` is read as its language model alone (text in, text out):
its text config with transformers' defaults filled in, its tensors renamed as the text model's,
the vision tower and projector never read.
"""

from __future__ import annotations

import json
import re
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

# multimodal architecture -> the architecture of the language model inside it
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Their language model's tensors: transformers 4 saved them as `language_model.model.*`, 5 saves
# `model.language_model.*`.
_TEXT_NAMES = ((re.compile(r"^(?:language_model\.model|model\.language_model)\."), "model."),
               (re.compile(r"^language_model\.lm_head\."), "lm_head."))
_NOT_TEXT = re.compile(r"^(?:model\.)?(?:vision_tower|multi_modal_projector)\.")
# top-level fields a text config may leave to its wrapper
_WRAPPER_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config")


def read_hf_config(model_dir: str | Path) -> dict:
    """Return the parsed `config.json` of a Hugging Face model directory (for a multimodal one of
    `TEXT_MODELS`, its language model's)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config = json.loads(path.read_text())
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in TEXT_MODELS:
        return config
    # A multimodal config.json lists only the text fields that differ from transformers'
    # defaults (Gemma 3 4B: not even its heads), so transformers fills them in.
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_dir).get_text_config().to_dict()
    wrapper = {k: config[k] for k in _WRAPPER_FIELDS if k in config and text.get(k) is None}
    return {**text, **wrapper, "architectures": [TEXT_MODELS[architecture]]}


def _text_name(name: str) -> str | None:
    """A tensor's name in the language model, None for a vision part."""
    if _NOT_TEXT.match(name):
        return None
    for pattern, replacement in _TEXT_NAMES:
        name = pattern.sub(replacement, name)
    return name


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
    """Yield (HF tensor name, array) for every tensor in the model's safetensors files (of a
    multimodal model, its language model's, under the text model's names)."""
    for path in safetensors_files(model_dir):
        header, data_start = _read_header(path)
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                text_name = _text_name(name)
                if text_name is None:
                    continue
                entry = header[name]
                if entry["dtype"] in _ML_DTYPES:
                    yield text_name, _read_raw(path, data_start, entry)
                else:
                    yield text_name, f.get_tensor(name)


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
