"""Weights as the model's matmuls see them: a float array, or a quantized weight dequantised inside
the jitted step right before its dot, so that XLA fuses the conversion and only the narrow bytes
are read from memory.

Every weight is `[in, out]`. A quantized weight holds

  value  [in, out] int8 | float8_e4m3fn (its bytes on a CPU: float8.py), or [in / 2, out] uint8
         for 4-bit (two nibbles a byte)
  scale  [groups, out]   each group of `in / groups` consecutive rows shares one scale per column
  min    [groups, out]   4-bit only: w = q * scale + min (q in 0..15)

and `w = value * scale` otherwise. Per-output-channel scales are one group. A 4-bit byte holds row
`i` in its low nibble and row `i + in / 2` in its high nibble: each half of the rows is then one
fused convert away from a plain dot (a nibble interleave made XLA's CPU dot 3.7x slower).

The vocabulary-sized weights (embedding, LM head) are stored `vocab_major` when quantized: every
part transposed (`[vocab, hidden]`, groups along hidden), so a lookup dequantises only its rows,
and the LM head runs as a loop over slices of about 1,024 vocabulary rows. XLA's CPU dot fuses
the dequantisation only while the weight is small: over the whole 49,152 x 576 head it wrote a
float copy first (8 rows: 57 ms against 15 ms in float32); by slices, 8.4 ms.

On a CPU, float8 values are kept as their bytes (`float8.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.layers import float8

KINDS = ("int8", "fp8", "uint4")


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored. `group_size` 0: one scale per output channel."""

    kind: str                 # int8 | fp8 | uint4
    group_size: int = 0
    scale_dtype: str = "float32"
    name: str = ""            # for logs and checkpoints: Q4_1, int8, ...

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"weight kind {self.kind!r} is not one of {KINDS}")

    @property
    def value_dtype(self):
        return {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "uint4": jnp.uint8}[self.kind]

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == 0 else in_features // self.group_size

    def check(self, name: str, in_features: int) -> None:
        """Raises ValueError when `in_features` does not split into this format's groups."""
        size = self.group_size or in_features
        if in_features % size:
            raise ValueError(f"{name}: {in_features} input features do not split into {size}-row blocks, "
                             f"which {self.name or self.kind} needs")
        if self.kind == "uint4" and size % 2:
            raise ValueError(f"{name}: {self.name or self.kind} groups {size} rows; 4-bit groups need an even "
                             f"number, the two rows of a byte sharing one group")

    def shapes(self, in_features: int, out_features: int) -> dict[str, tuple[tuple[int, ...], object]]:
        """part name -> (shape, dtype)."""
        rows = in_features // 2 if self.kind == "uint4" else in_features
        groups = (self.groups(in_features), out_features)
        parts = {"value": ((rows, out_features), self.value_dtype), "scale": (groups, jnp.dtype(self.scale_dtype))}
        if self.kind == "uint4":
            parts["min"] = (groups, jnp.dtype(self.scale_dtype))
        return parts

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class QuantizedWeight(nnx.Module):
    """A quantized `[in, out]` weight; its parts are `nnx.Param`s named value, scale (and min),
    each stored transposed when `vocab_major`."""

    def __init__(self, fmt: WeightFormat, in_features: int, out_features: int, vocab_major: bool = False):
        self.fmt = fmt
        self.vocab_major = vocab_major
        for part, (shape, dtype) in fmt.shapes(in_features, out_features).items():
            setattr(self, part, nnx.Param(jnp.zeros(shape[::-1] if vocab_major else shape, dtype)))
        if fmt.kind != "uint4":
            self.min = None

    def parts(self) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        return self.value[...], self.scale[...], None if self.min is None else self.min[...]


Weight = nnx.Param | QuantizedWeight


def _values(kind: str, q: jax.Array, dtype) -> jax.Array:
    return float8.values(q, dtype) if kind == "fp8" else q.astype(dtype)


def _affine(q: jax.Array, scale: jax.Array, minimum: jax.Array | None, dtype, axis: int = 0) -> jax.Array:
    """q [rows, cols] -> [rows, cols] of `dtype`, with `scale` (and `minimum`) over groups of
    consecutive entries along `axis`: [groups, cols] for axis 0, [rows, groups] for axis 1."""
    groups = scale.shape[axis]
    grouped = q.shape[:axis] + (groups, q.shape[axis] // groups) + q.shape[axis + 1:]
    w = q.astype(dtype).reshape(grouped) * jnp.expand_dims(scale.astype(dtype), axis + 1)
    if minimum is not None:
        w = w + jnp.expand_dims(minimum.astype(dtype), axis + 1)
    return w.reshape(q.shape)


def _nibbles(value, scale, minimum, dtype, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """A 4-bit weight's even and odd rows along `axis` (its low and high nibbles), dequantised from
    its parts: a byte's two rows share one group, so each nibble's groups are the weight's."""
    return (_affine(value & 0xF, scale, minimum, dtype, axis), _affine(value >> 4, scale, minimum, dtype, axis))


def _interleave(even: jax.Array, odd: jax.Array, axis: int) -> jax.Array:
    shape = list(even.shape)
    shape[axis] *= 2
    return jnp.stack([even, odd], axis=axis + 1).reshape(shape)


def dequantize_parts(kind: str, value, scale, minimum, dtype) -> jax.Array:
    """`[in, out]` parts -> `[in, out]` of `dtype`."""
    if kind == "uint4":
        return _interleave(*_nibbles(value, scale, minimum, dtype), axis=0)
    return _affine(_values(kind, value, dtype), scale, None, dtype)


def dequantize(w: QuantizedWeight, dtype) -> jax.Array:
    """The whole weight as `[in, out]` of `dtype` (tests, and the reference arithmetic)."""
    if w.vocab_major:
        return _dequantize_rows(w.fmt.kind, *w.parts(), dtype).T
    return dequantize_parts(w.fmt.kind, *w.parts(), dtype)


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x [T, in] @ w [in, out] -> [T, out] in x's dtype."""
    if isinstance(w, nnx.Param):
        return x @ w[...]
    if w.vocab_major:
        return _vocab_matmul(x, w)
    value, scale, minimum = w.parts()
    if w.fmt.kind == "uint4":
        even, odd = _nibbles(value, scale, minimum, x.dtype)
        pairs = x.reshape(x.shape[0], -1, 2)
        return pairs[:, :, 0] @ even + pairs[:, :, 1] @ odd
    return x @ dequantize_parts(w.fmt.kind, value, scale, minimum, x.dtype)


VOCAB_SLICE = 1024


def _dequantize_rows(kind: str, value, scale, minimum, dtype) -> jax.Array:
    """Vocab-major parts ([rows, in], groups along `in`) -> [rows, in] of `dtype`."""
    if kind == "uint4":
        return _interleave(*_nibbles(value, scale, minimum, dtype, axis=1), axis=1)
    return _affine(_values(kind, value, dtype), scale, None, dtype, axis=1)


def _vocab_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [T, in] @ a vocab-major weight, one slice of vocabulary rows at a time (dequantised in
    its stored orientation: transposing each slice first made it 9x slower)."""
    vocab = w.value.shape[0]
    size = next((s for s in (VOCAB_SLICE, 512, 256, 128) if vocab % s == 0), vocab)
    parts = tuple(None if p is None else p.reshape(vocab // size, size, p.shape[1]) for p in w.parts())

    def one_slice(sliced):
        return x @ _dequantize_rows(w.fmt.kind, *sliced, x.dtype).T

    out = jax.lax.map(one_slice, parts)                       # [slices, T, size]
    return out.transpose(1, 0, 2).reshape(x.shape[0], vocab)


def embed_lookup(embed: Weight, token_ids: jax.Array, dtype) -> jax.Array:
    """token_ids [T] -> [T, hidden]; a quantized (vocab-major) embedding dequantises only those rows."""
    if isinstance(embed, nnx.Param):
        return embed[...][token_ids]
    return _dequantize_rows(embed.fmt.kind, *(None if p is None else p[token_ids] for p in embed.parts()), dtype)


def lm_head(x: jax.Array, embed: Weight, head: Weight | None) -> jax.Array:
    """x [S, hidden] -> [S, vocab]: the LM head, or the tied embedding's transpose."""
    if head is not None:
        return matmul(x, head)
    if isinstance(embed, nnx.Param):
        return x @ embed[...].T
    return matmul(x, embed)
