"""float8_e4m3fn arrays kept as their bytes on a CPU.

XLA's CPU code handles float8 arrays slowly where our steps use them most: sliced inside the
layers' scan, 30 layers of 576 x 1536 weights took 42.5 ms a one-row step against 5.8 ms as int8
and 6.2 ms as bytes; a float8 KV pool made every decode step scale with the pool's size (the
embedded model: 1.56 s at 115 pages, 6.1 s at 465, against 45 ms for int8 pages). Turning the
arrays into bytes inside the step copies all of them each step instead (one stream of the
embedded model: 14.6 tok/s against 26 tok/s with bytes stored). So on a CPU, fp8 weights (at
load) and fp8 KV pages (the XLA backend's) are stored as uint8, and decoded here by integer
arithmetic right where they are read. On TPU and GPU they keep their dtype. Readers take either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT8 = jnp.dtype(jnp.float8_e4m3fn)
BYTES = jnp.dtype(jnp.uint8)


def stored_dtype(dtype):
    """The dtype an array of `dtype` is kept in: float8_e4m3fn's bytes on a CPU."""
    return BYTES if jnp.dtype(dtype) == FLOAT8 and jax.default_backend() == "cpu" else jnp.dtype(dtype)


def as_stored(tree):
    """`tree` with its float8_e4m3fn arrays in `stored_dtype`."""
    return jax.tree.map(lambda a: to_bytes(a) if stored_dtype(a.dtype) != a.dtype else a, tree)


def to_bytes(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def values(q: jax.Array, dtype) -> jax.Array:
    """`q` as `dtype`; bytes (uint8) are float8_e4m3fn's. A byte is a sign, 4 exponent bits (bias
    7) and 3 mantissa bits: a normal number moves into float32's fields with its exponent rebiased
    to 127; an exponent of 0 is a subnormal (mantissa x 2^-9); all ones is NaN (there is no inf)."""
    if q.dtype != BYTES:
        return q.astype(dtype)
    b = q.astype(jnp.int32)
    magnitude = b & 0x7F
    normal = jax.lax.bitcast_convert_type((magnitude << 20) + (120 << 23), jnp.float32)
    v = jnp.where(magnitude < 8, (magnitude & 7).astype(jnp.float32) * (2.0 ** -9), normal)
    v = jnp.where(magnitude == 0x7F, jnp.nan, v)
    return jnp.where(b >= 128, -v, v).astype(dtype)
