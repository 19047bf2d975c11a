"""Hugging Face PEFT LoRA adapters: `adapter_config.json` and `adapter_model.safetensors` (or .bin
refused: pickle) read into per-module host arrays the engine's adapter slots take.

A LoRA module adds `(x @ A) @ B * scaling` to a projection `x @ W`, with A `[in, r]` and B
`[r, out]` in our `[in, out]` convention (PEFT stores `lora_A.weight` `[r, in]` and `lora_B.weight`
`[out, r]`). `scaling` is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA; it is folded
into B here. Modules: the attention and MLP projections q/k/v/o and gate/up/down of every layer
(or of `layers_to_transform`), and Phi-3's fused qkv_proj / gate_up_proj, split as the base
weights are. What we do not read (DoRA, embedding or LM-head adapters, `modules_to_save`, per-module
rank or alpha patterns, trained biases) is refused by name, never served wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from jaxserve.config import ModelConfig
from jaxserve.models.llama import lora_shapes

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights on the host: module -> (A [layers, in, rank], B [layers, rank, out]),
    float32, scaling folded into B; layers it does not adapt are zeros."""

    path: str
    rank: int
    modules: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def _refuse(path: Path, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {what}")


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise _refuse(path, "no adapter_config.json (a PEFT adapter directory holds adapter_config.json "
                            "and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    checks = [
        (config.get("peft_type", "LORA") == "LORA", f"peft_type={config.get('peft_type')!r} is not LORA"),
        (not config.get("use_dora"), "use_dora=true (DoRA) is not supported"),
        (config.get("bias", "none") == "none", f"bias={config.get('bias')!r}: trained biases are not supported"),
        (not config.get("modules_to_save"), f"modules_to_save={config.get('modules_to_save')} is not supported"),
        (not config.get("rank_pattern") and not config.get("alpha_pattern"),
         "rank_pattern / alpha_pattern (per-module ranks) are not supported"),
        (not config.get("fan_in_fan_out"), "fan_in_fan_out=true (Conv1D weights) is not supported"),
        (isinstance(config.get("r"), int) and config["r"] >= 1, f"r={config.get('r')!r} must be an integer >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise _refuse(path, message)
    return config


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads and checks an adapter against the base model's `cfg` (its original head counts)."""
    path = Path(path)
    if not path.is_dir():
        raise _refuse(path, "is not a directory")
    config = read_config(path)
    rank = config["r"]
    if rank > max_rank:
        raise _refuse(path, f"rank r={rank} exceeds max_lora_rank={max_rank}; raise --max-lora-rank")
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise _refuse(path, "no adapter_model.safetensors (pickled .bin adapters are not read)")
    scaling = config.get("lora_alpha", rank) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise _refuse(path, f"tensor {key!r} is not a LoRA A/B of a decoder layer's projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in MODULES and module not in FUSED:
            raise _refuse(path, f"module {module!r} ({key}) is not one of {MODULES + tuple(FUSED)}")
        if not 0 <= layer < cfg.num_layers:
            raise _refuse(path, f"{key}: layer {layer} is outside the base model's {cfg.num_layers} layers")
        found.setdefault(module, {}).setdefault(layer, {})[which] = tensor.astype(np.float32)
    shapes = lora_shapes(cfg)
    modules = {}
    for module, layers in found.items():
        parts = FUSED.get(module, (module,))
        splits = np.cumsum([shapes[p][1] for p in parts])[:-1]
        for part in parts:
            modules[part] = (np.zeros((cfg.num_layers, shapes[part][0], rank), np.float32),
                             np.zeros((cfg.num_layers, rank, shapes[part][1]), np.float32))
        for layer, pair in layers.items():
            if set(pair) != {"A", "B"}:
                raise _refuse(path, f"layer {layer} {module}: lora_A and lora_B must both be present")
            a, b = pair["A"], pair["B"]
            out_features = sum(shapes[p][1] for p in parts)
            if a.shape != (rank, shapes[parts[0]][0]) or b.shape != (out_features, rank):
                raise _refuse(path, f"layer {layer} {module}: lora_A {a.shape} and lora_B {b.shape} do not fit the "
                                    f"base model's [{shapes[parts[0]][0]} -> {out_features}] at rank {rank}")
            for part, b_part in zip(parts, np.split(b, splits)):
                modules[part][0][layer] = a.T
                modules[part][1][layer] = b_part.T * scaling
    if not modules:
        raise _refuse(path, "adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(str(path), rank, modules)
