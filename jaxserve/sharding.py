"""The device mesh and where every array lives on it: one table from parameter path to PartitionSpec.

The mesh has axes `('data', 'model')`. `model` is tensor parallelism: attention heads and KV heads,
the MLP's intermediate dimension and the vocabulary of the embedding and LM head are split over
it; XLA inserts the collectives. A mixture of experts' experts are split over it whole (expert
parallelism, `jaxserve.models.layers.moe`). `data` is data parallelism inside the one program: every step's
arrays are D slices laid end to end on their leading (token or row) axis and split over `data`,
and each slice's sequences live in that slice's own part of the KV pool. Weights are replicated
over `data`. Attention runs under `shard_map` over both axes, each device on its slice's
sequences, its own heads, and its own block of the KV pool (`[layers, kv_heads, pages,
page_size, head_dim]`, split on the KV-head axis over `model` and on the page axis over `data`),
addressed by page ids local to the slice.

Head counts that do not divide by the `model` size are made to (`pad_heads`): KV heads fewer than
the axis are replicated when the query heads allow it, otherwise heads are padded with zero
weights, which adds nothing to the output (a zero query head's output meets zero `o_proj` rows).
Either way the result is exact; the cost is the extra heads' weights and KV pool memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig, parse_mesh
from jaxserve.quantization import pack_uint4, unpack_uint4

log = logging.getLogger(__name__)

AXES = ("data", "model")

# Parameter path (slash-joined) -> spec. Layer weights carry a leading layer axis. Linear weights
# are [in, out]: column-parallel ones split `out`, row-parallel ones split `in`. A quantized
# weight's parts (`/value`, `/scale`, `/min`) are all [rows or groups, out] and split alike; a
# quantized LM head is stored [vocab, hidden] (vocab-major), as the embedding always is.
_PARTS = r"(/(value|scale|min))?"
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"embed" + _PARTS, P("model", None)),                            # vocab-split
    (r"lm_head/(value|scale|min)", P("model", None)),
    (r"lm_head", P(None, "model")),
    (r"layers/(q_proj|k_proj|v_proj|gate_proj|up_proj)" + _PARTS, P(None, None, "model")),
    (r"layers/(q_bias|k_bias|v_bias|gate_bias|up_bias)", P(None, "model")),
    (r"layers/(o_proj|down_proj)" + _PARTS, P(None, "model", None)),
    # experts [layers, experts, in, out] (and their quantized parts): expert parallelism, whole
    # experts per device
    (r"layers/(gate|up|down)_experts" + _PARTS, P(None, "model", None, None)),
    # LoRA slots [layers, in, slots, R] / [layers, slots, R, out]: B as its column-parallel base, A
    # as its row-parallel base; the rest replicated
    (r"lora/(q_proj|k_proj|v_proj|gate_proj|up_proj)/b", P(None, None, None, "model")),
    (r"lora/(o_proj|down_proj)/a", P(None, "model", None, None)),
    (r".*", P()),                                                     # norms, output biases
)
KV_POOL_SPEC = P(None, "model", "data", None, None)                  # KV heads x pages
BATCH_SPEC = P("data")                # every step array: slices end to end on the leading axis


def ensure_devices(num_devices: int) -> bool:
    """On a CPU-only host, asks JAX for `num_devices` host devices. Must run before JAX's backend
    starts. True if it set the count."""
    if os.environ.get("JAX_PLATFORMS", "cpu") not in ("", "cpu") or num_devices <= 1:
        return False
    jax.config.update("jax_num_cpu_devices", num_devices)
    return True


def make_mesh(shape: tuple[int, int]) -> Mesh:
    data, model = shape
    devices = jax.devices()
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices; {len(devices)} are available "
                         f"({devices[0].platform})")
    return Mesh(np.array(devices[:data * model]).reshape(data, model), AXES)


def mesh_from_config(text: str) -> Mesh | None:
    """The engine's mesh for `EngineConfig.mesh`; None for 1x1 (one device, no sharding)."""
    shape = parse_mesh(text)
    return None if shape == (1, 1) else make_mesh(shape)


def place(tree, sharding: NamedSharding):
    """`jax.device_put(tree, sharding)` for host values (numpy) that every process holds whole.
    Over several processes each places only its own devices' shards, cut from its copy: there
    device_put first checks that all processes hold the same value, by gathering each array from
    every process into each, through a program compiled for its shape: every weight at load, every
    array of every step (README, "Several hosts")."""
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def one(value):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    return jax.tree.map(one, tree)


def spec_for(path: str) -> P:
    return next(spec for pattern, spec in PARTITION_RULES if re.fullmatch(pattern, path))


def sharding_for(mesh: Mesh, path: str, shape: tuple[int, ...]) -> NamedSharding:
    """The rule's sharding, with any axis that does not divide by its mesh axis replicated."""
    rule = spec_for(path)
    spec = list(rule) + [None] * (len(shape) - len(rule))
    for i, axis in enumerate(spec):
        if axis is not None and shape[i] % mesh.shape[axis]:
            if shape[i] > 1:   # a one-group scale is replicated by design
                log.warning("%s: dimension %d (%d) does not divide by mesh axis %r (%d); replicated",
                            path, i, shape[i], axis, mesh.shape[axis])
            spec[i] = None
    return NamedSharding(mesh, P(*spec))


# ---- head counts ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How heads are rearranged for `model`-way splitting: KV head `k` becomes KV heads
    `k * replicas ... k * replicas + replicas - 1`, each serving `group` query heads; then `pad_kv`
    zero KV heads (each with `group` zero query heads) are appended."""

    num_kv_heads: int       # original
    group: int              # query heads per KV head, after replication
    replicas: int
    pad_kv: int

    @property
    def unchanged(self) -> bool:
        return self.replicas == 1 and self.pad_kv == 0

    @property
    def new_kv_heads(self) -> int:
        return self.num_kv_heads * self.replicas + self.pad_kv

    @property
    def new_heads(self) -> int:
        return self.new_kv_heads * self.group


def head_layout(cfg: ModelConfig, model_size: int) -> HeadLayout:
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kv % model_size == 0:
        return HeadLayout(kv, group, 1, 0)
    if model_size % kv == 0 and group % (model_size // kv) == 0:
        replicas = model_size // kv
        return HeadLayout(kv, group // replicas, replicas, 0)
    return HeadLayout(kv, group, 1, math.ceil(kv / model_size) * model_size - kv)


def pad_heads(cfg: ModelConfig, params: dict[tuple[str, ...], np.ndarray],
              model_size: int) -> tuple[ModelConfig, dict[tuple[str, ...], np.ndarray]]:
    """The config and host weights rearranged so that heads and KV heads divide by `model_size`."""
    layout = head_layout(cfg, model_size)
    if layout.unchanged:
        return cfg, params
    log.info("heads %d/%d (query/KV) do not split %d ways: running %d/%d (%s); KV pool and attention "
             "weights grow %.2fx", cfg.num_heads, cfg.num_kv_heads, model_size, layout.new_heads,
             layout.new_kv_heads, "KV heads replicated" if layout.replicas > 1 else "zero heads added",
             layout.new_kv_heads / cfg.num_kv_heads)
    hd, out = cfg.head_dim, dict(params)
    # Heads lie on the last (out) axis of q/k/v and of their quantized parts.
    for path, w in params.items():
        if path[:2] in (("layers", "q_proj"), ("layers", "q_bias")):
            out[path] = _query_heads(w, layout, hd)
        elif path[:2] in (("layers", n) for n in ("k_proj", "v_proj", "k_bias", "v_bias")):
            out[path] = _kv_heads(w, layout, hd)
    # o_proj's heads lie on its rows (axis 1): [L, heads * hd, d], and [L, groups, d] for scales;
    # only added zero heads change them (replicating KV heads leaves the query heads in order).
    for path, w in params.items():
        if path[:2] != ("layers", "o_proj") or w.shape[1] == 1 or layout.pad_kv == 0:
            continue
        packed = path[2:] == ("value",) and w.shape[1] * 2 == cfg.num_heads * hd
        rows = unpack_uint4(w) if packed else w
        if rows.shape[1] % cfg.num_heads:
            raise ValueError(f"{'/'.join(path)}: {rows.shape[1]} rows do not split by head ({cfg.num_heads} "
                             f"heads): a quantization group spans heads, so heads cannot be rearranged for "
                             f"a {model_size}-way model axis; use --quantization none or a mesh M that "
                             f"divides {cfg.num_kv_heads}")
        per_head = rows.shape[1] // cfg.num_heads
        rows = np.swapaxes(_query_heads(np.swapaxes(rows, 1, 2), layout, per_head), 1, 2)
        out[path] = pack_uint4_stack(rows) if packed else rows
    return dataclasses.replace(cfg, num_heads=layout.new_heads, num_kv_heads=layout.new_kv_heads), out


def pack_uint4_stack(q: np.ndarray) -> np.ndarray:
    """`pack_uint4` over a stack [L, in, out]."""
    return np.stack([pack_uint4(layer) for layer in q])


def _query_heads(w: np.ndarray, layout: HeadLayout, hd: int) -> np.ndarray:
    """[..., kv * group_orig * hd] -> [..., new_heads * hd], heads regrouped by their KV head."""
    lead = w.shape[:-1]
    w = w.reshape(*lead, layout.num_kv_heads * layout.replicas, layout.group, hd)
    pad = [(0, 0)] * len(lead) + [(0, layout.pad_kv), (0, 0), (0, 0)]
    return np.pad(w, pad).reshape(*lead, layout.new_heads * hd)


def _kv_heads(w: np.ndarray, layout: HeadLayout, hd: int) -> np.ndarray:
    lead = w.shape[:-1]
    w = np.repeat(w.reshape(*lead, layout.num_kv_heads, hd), layout.replicas, axis=-2)
    pad = [(0, 0)] * len(lead) + [(0, layout.pad_kv), (0, 0)]
    return np.pad(w, pad).reshape(*lead, layout.new_kv_heads * hd)


def pad_lora_heads(cfg: ModelConfig, modules: dict[str, tuple[np.ndarray, np.ndarray]],
                   model_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A LoRA adapter's A [L, in, r] / B [L, r, out] rearranged as `pad_heads` rearranges the base
    weights (`cfg`: the base model's original head counts): q/k/v's B on their heads, o's A rows."""
    layout = head_layout(cfg, model_size)
    if layout.unchanged:
        return modules
    hd, out = cfg.head_dim, dict(modules)
    for name, (a, b) in modules.items():
        if name == "q_proj":
            out[name] = (a, _query_heads(b, layout, hd))
        elif name in ("k_proj", "v_proj"):
            out[name] = (a, _kv_heads(b, layout, hd))
        elif name == "o_proj":
            out[name] = (np.swapaxes(_query_heads(np.swapaxes(a, 1, 2), layout, hd), 1, 2), b)
    return out
