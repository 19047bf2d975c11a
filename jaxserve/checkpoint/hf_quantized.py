"""Hugging Face checkpoints whose `config.json` has a `quantization_config`: their packed tensors
read into `QuantizedTensor`s (kept quantized with `--quantization auto`), never as floats.

compressed-tensors (llm-compressor's output; `quant_method: compressed-tensors`), per module:
  pack-quantized   weight_packed int32 [out, in * bits / 32], element i at bits i * bits of its
                   word, stored unsigned (q + 2^(bits-1)); weight_scale [out, groups];
                   weight_zero_point (asymmetric) packed the same way along `out`; weight_shape
  int-/naive-quantized  weight int8 (q itself); weight_scale; weight_zero_point (asymmetric)
  float-quantized  weight float8_e4m3fn; weight_scale [out, 1] (channel) or [1] (tensor)
  w = (q - zero_point) * scale. Strategies channel, group and tensor; 4 and 8 bits for ints.
AWQ (`quant_method: awq`, version gemm): qweight int32 [in, out / 8], qzeros int32 [in / g, out / 8],
  scales [in / g, out]; each word holds 8 columns in the order 0 2 4 6 1 3 5 7 (AutoAWQ's
  packing); w = (q - z) * s.

Both 4-bit forms become our `uint4` (w = u * s + m, u the stored unsigned nibble), int8 stays
int8, fp8 stays fp8. A scheme we can decode but not compute with (asymmetric int8) is dequantised
at load with a log line; a method, format or strategy we cannot decode is refused by name.
Activation and KV-cache scales (w8a8 checkpoints) are not used: activations stay in the compute
dtype, as vLLM runs fp8 checkpoints weight-only on hardware without fp8 matmuls.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from jaxserve.models.layers.linear import WeightFormat
from jaxserve.quantization import QuantizedTensor

log = logging.getLogger(__name__)

CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
CT_STRATEGIES = ("channel", "group", "tensor")
AWQ_VERSIONS = ("gemm",)
METHODS = ("compressed-tensors", "awq")

# Calibration scales of w8a8 and KV-cache schemes: not needed for weight-only compute.
_UNUSED_SUFFIXES = (".input_scale", ".input_zero_point", ".output_scale", ".k_scale", ".v_scale",
                    ".input_global_scale")

_CT_PARTS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_AWQ_PARTS = ("qweight", "qzeros", "scales")
_AWQ_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])   # column 8j + k sits in nibble _AWQ_ORDER[k] of word j


@dataclasses.dataclass(frozen=True)
class Scheme:
    method: str     # compressed-tensors | awq
    group_size: int = 0   # AWQ only: compressed-tensors tensors carry their own groups


def read_scheme(hf_config: dict) -> Scheme | None:
    """The checkpoint's quantization scheme, None for a float checkpoint. Raises ValueError naming
    a method, format or option we do not read: loading its packed tensors as floats would be
    silently wrong."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "awq":
        return _awq_scheme(qc)
    raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which jaxserve does not "
                     f"read (it reads {METHODS}); give a float checkpoint (then --quantization int8, fp8 or int4 "
                     f"quantizes it at load) or a GGUF file")


def _refuse(what: str, value, allowed) -> None:
    raise ValueError(f"the checkpoint's quantization_config has {what} {value!r}, which jaxserve does not read "
                     f"(it reads {tuple(allowed)})")


def _compressed_tensors_scheme(qc: dict) -> Scheme:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        _refuse("compressed-tensors format", fmt, CT_FORMATS)
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        _refuse("sparsity_config format", sparsity["format"], ("dense",))
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = (weights.get("type", "int"), weights.get("num_bits"))
        if kind not in (("int", 4), ("int", 8), ("float", 8)):
            _refuse(f"config_groups.{name}.weights type/num_bits", f"{kind[0]}{kind[1]}", ("int4", "int8", "float8"))
        if weights.get("strategy") not in CT_STRATEGIES:
            _refuse(f"config_groups.{name}.weights strategy", weights.get("strategy"), CT_STRATEGIES)
        if group.get("input_activations"):
            log.info("the checkpoint's %s quantizes activations too; jaxserve computes them in the compute dtype "
                     "(weight-only)", name)
    return Scheme("compressed-tensors")


def _awq_scheme(qc: dict) -> Scheme:
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        _refuse("AWQ version", version, AWQ_VERSIONS)
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        _refuse("AWQ bits", qc.get("bits", qc.get("w_bit")), (4,))
    if not qc.get("zero_point", True):
        _refuse("AWQ zero_point", False, (True,))
    return Scheme("awq", int(qc.get("group_size", qc.get("q_group_size", 128))))


def quantized_tensors(tensors: Iterable[tuple[str, np.ndarray]], scheme: Scheme
                      ) -> Iterator[tuple[str, np.ndarray | QuantizedTensor]]:
    """(HF name, array) -> (HF name, array or QuantizedTensor): each quantized module's parts
    gathered (in whatever order the files hold them) into one `<module>.weight`."""
    parts_of = _AWQ_PARTS if scheme.method == "awq" else _CT_PARTS
    modules: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        if name.endswith(_UNUSED_SUFFIXES):
            continue
        module, _, part = name.rpartition(".")
        if part in parts_of:
            modules.setdefault(module, {})[part] = array
        else:
            yield name, array
    for module, parts in modules.items():
        if scheme.method == "awq":
            yield f"{module}.weight", _awq_module(module, parts, scheme)
        elif "weight_scale" in parts:
            yield f"{module}.weight", _ct_module(module, parts)
        else:   # a module the scheme leaves float (its `ignore` list)
            yield from ((f"{module}.{part}", array) for part, array in parts.items())


def _unpack(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 [rows, words] -> unsigned [rows, count]: element i at bits i * bits (little-endian)."""
    raw = np.ascontiguousarray(words).astype("<i4").view(np.uint8)     # [rows, 4 * words]
    if bits == 4:
        raw = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(words.shape[0], -1)
    return raw[:, :count]


def _ct_module(module: str, parts: dict[str, np.ndarray]) -> np.ndarray | QuantizedTensor:
    if "weight_g_idx" in parts:
        raise ValueError(f"{module}: the checkpoint stores weight_g_idx (activation ordering), which jaxserve does "
                         "not read; quantize with actorder static or none")
    scale = np.asarray(parts["weight_scale"], np.float32)
    if "weight_packed" in parts:
        out, inp = (int(n) for n in np.asarray(parts["weight_shape"]).reshape(-1))
        bits = parts["weight_packed"].shape[1] * 32 // inp
        if bits not in (4, 8):
            raise ValueError(f"{module}: weight_packed holds {bits}-bit values; jaxserve reads 4 and 8")
        signed = _unpack(parts["weight_packed"], bits, inp).astype(np.int16) - (1 << (bits - 1))
    else:   # q itself, int8 (w = q * s holds whatever its range) or float8_e4m3fn
        signed, bits = parts["weight"], 8
        out, inp = signed.shape
        if signed.dtype not in (np.int8, ml_dtypes.float8_e4m3fn):
            raise ValueError(f"{module}: a quantized weight of dtype {signed.dtype}, which jaxserve does not read "
                             "(it reads int8 and float8_e4m3fn)")
    scale = _scale_rows(scale, out)
    zero = parts.get("weight_zero_point")
    if zero is not None and "weight_packed" in parts:   # packed along `out`
        zero = _unpack(np.asarray(zero).T, bits, out).T.astype(np.int16) - (1 << (bits - 1))
    if signed.dtype == ml_dtypes.float8_e4m3fn:
        return QuantizedTensor(WeightFormat("fp8", _group(inp, scale), "float32", "compressed-tensors fp8"),
                               signed, np.ascontiguousarray(scale))
    zero = np.zeros(scale.shape, np.int16) if zero is None else np.asarray(zero, np.int16).reshape(scale.shape)
    if bits == 8:
        if zero.any():
            log.info("%s: asymmetric int8 weights are dequantised at load (jaxserve's int8 is symmetric)", module)
            fmt = WeightFormat("int8", _group(inp, scale), "float32", "asymmetric int8")
            return QuantizedTensor(fmt, signed, scale, -zero.astype(np.float32) * scale).dequantized()
        return QuantizedTensor(WeightFormat("int8", _group(inp, scale), "float32", "compressed-tensors int8"),
                               np.asarray(signed, np.int8), np.ascontiguousarray(scale))
    return _uint4(signed + 8, scale, zero + 8, "compressed-tensors int4")


def _awq_module(module: str, parts: dict[str, np.ndarray], scheme: Scheme) -> QuantizedTensor:
    inp, out = parts["qweight"].shape[0], parts["qweight"].shape[1] * 8

    def columns(words):   # int32 [rows, out / 8] -> [rows, out] in column order
        nibbles = _unpack(words, 4, words.shape[1] * 8).reshape(words.shape[0], -1, 8)
        return nibbles[:, :, _AWQ_ORDER].reshape(words.shape[0], out)

    q, z = columns(parts["qweight"]), columns(parts["qzeros"])
    scale = np.asarray(parts["scales"], np.float32)
    if scale.shape[0] * scheme.group_size != inp:
        raise ValueError(f"{module}: scales has {scale.shape[0]} groups, but {inp} inputs in groups of "
                         f"group_size={scheme.group_size} make {inp // scheme.group_size}")
    return _uint4(q.T, scale.T, z.T, "AWQ int4")


def _uint4(u: np.ndarray, scale: np.ndarray, zero: np.ndarray, name: str) -> QuantizedTensor:
    """Unsigned nibbles [out, in] with w = (u - zero) * scale over groups -> our uint4 (w = u * s + m).
    One group (per channel) is split in two: our 4-bit layout needs an even number of groups."""
    inp = u.shape[1]
    if scale.shape[1] == 1:
        scale, zero = np.repeat(scale, 2, axis=1), np.repeat(zero, 2, axis=1)
    scale = np.ascontiguousarray(scale, np.float32)
    return QuantizedTensor(WeightFormat("uint4", inp // scale.shape[1], "float32", name),
                           np.asarray(u, np.uint8), scale, -zero.astype(np.float32) * scale)


def _scale_rows(scale: np.ndarray, out: int) -> np.ndarray:
    """weight_scale as [out, groups]: per tensor ([1] or [1, 1]) broadcast to every channel."""
    if scale.size == 1:
        return np.full((out, 1), scale.reshape(()), np.float32)
    return scale.reshape(out, -1)


def _group(inp: int, scale: np.ndarray) -> int:
    return 0 if scale.shape[1] == 1 else inp // scale.shape[1]
