"""RMSNorm, computed in float32 as Hugging Face does: Llama's and Gemma's."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalises the last axis of `x` and scales by `weight`; returns `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's: scaled by `1 + weight`, in float32 before the cast back (Llama casts first)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
