"""Quantized weights on the host: quantizing float weights at load, and the checkpoint side of the
formats `jaxserve.models.layers.linear` computes with.

`--quantization` (vLLM's flag):
  auto   whatever the checkpoint carries: a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors natively,
         float weights stay float
  none   every weight dequantised to `--dtype`
  int8   per output channel, symmetric: w = q * s, q in -127..127
  fp8    per output channel: w = q * s, q float8_e4m3fn, s = max|w| / 448
  int4   groups of 32 input rows, asymmetric: w = q * s + m, q in 0..15 (GGUF Q4_1's and AWQ's form)
The quantizing choices apply to the linear layers; the embedding and LM head keep the compute dtype
unless the checkpoint itself quantizes them.

Host arrays of a quantized weight (`QuantizedTensor`) are kept in the checkpoint's own orientation
(`[out, in]`, unpacked nibbles) until `ours()` transposes and packs them into the device layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np

from jaxserve.config import QUANTIZATIONS
from jaxserve.models.layers.linear import WeightFormat

INT4_GROUP = 32
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)   # 448

AT_LOAD = {
    "int8": WeightFormat("int8", 0, "float32", "int8"),
    "fp8": WeightFormat("fp8", 0, "float32", "fp8"),
    "int4": WeightFormat("uint4", INT4_GROUP, "float32", "int4"),
}


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A quantized weight as a checkpoint stores it: `[out, in]` rows, blocks along `in`.

    value [out, in] int8 / float8_e4m3fn, or uint8 nibbles 0..15 (not yet packed)
    scale [out, groups], min [out, groups] (4-bit only)
    """

    fmt: WeightFormat
    value: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.value.shape

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> "QuantizedTensor":
        """The same weight with `fn` applied to the row (output) order of every part."""
        return dataclasses.replace(self, value=fn(self.value), scale=fn(self.scale),
                                   min=None if self.min is None else fn(self.min))

    def dequantized(self) -> np.ndarray:
        """float32 `[out, in]`, the reference arithmetic."""
        out, inp = self.value.shape
        groups = self.scale.shape[1]
        q = self.value.astype(np.float32).reshape(out, groups, inp // groups)
        w = q * self.scale.astype(np.float32)[:, :, None]
        if self.min is not None:
            w = w + self.min.astype(np.float32)[:, :, None]
        return w.reshape(out, inp)

    def ours(self, vocab_major: bool = False) -> dict[str, np.ndarray]:
        """The device layout: parts `[in, out]` (`[out, in]` when `vocab_major`), nibbles packed by
        pairs of rows of `in` (`pack_uint4`)."""
        parts = {"value": self.value.T, "scale": self.scale.T}
        if self.fmt.kind == "uint4":
            parts["value"] = pack_uint4(parts["value"])
            parts["min"] = self.min.T
        if vocab_major:
            parts = {name: a.T for name, a in parts.items()}
        dtypes = {"scale": self.fmt.scale_dtype, "min": self.fmt.scale_dtype, "value": self.fmt.value_dtype}
        return {name: np.ascontiguousarray(a, dtype=dtypes[name]) for name, a in parts.items()}


def pack_uint4(q: np.ndarray) -> np.ndarray:
    """[in, out] values 0..15 -> [in / 2, out] uint8: row 2i in the low nibble of row i, row 2i + 1
    in its high one. Both rows of a byte are in one quantization group (groups have an even size),
    and in one shard of any even split of `in` over a mesh: packed by halves of `in` instead, a
    row-parallel weight's nibbles and its input lay in different shards, and every layer moved
    them between devices (10 collective permutes per layer on a 4x2 mesh)."""
    return (q[0::2].astype(np.uint8) | (q[1::2].astype(np.uint8) << 4)).astype(np.uint8)


def unpack_uint4(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_uint4`: [in / 2, out] -> [in, out] on the second-to-last axis too for stacks."""
    pairs = np.stack([packed & 0xF, packed >> 4], axis=-2)     # [..., in / 2, 2, out]
    return pairs.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1])


def quantize(w: np.ndarray, fmt: WeightFormat) -> QuantizedTensor:
    """Quantizes a float `[out, in]` weight into `fmt` (one of `AT_LOAD`)."""
    w = np.asarray(w, np.float32)
    if fmt.kind == "uint4":
        out, inp = w.shape
        g = w.reshape(out, inp // fmt.group_size, fmt.group_size)
        low, high = g.min(axis=-1), g.max(axis=-1)
        scale = np.where(high > low, (high - low) / 15, 1.0).astype(np.float32)
        q = np.clip(np.rint((g - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
        return QuantizedTensor(fmt, q.reshape(out, inp), scale, low.astype(np.float32))
    top = {"int8": 127.0, "fp8": FP8_MAX}[fmt.kind]
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    if fmt.kind == "int8":
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    else:
        q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    return QuantizedTensor(fmt, q, scale)


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization={name!r} is not one of {QUANTIZATIONS}")
