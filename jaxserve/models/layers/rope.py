"""Rotary position embeddings in Hugging Face's rotate-half layout: Llama 3's frequency scaling,
Phi-3's LongRoPE and partial rotation (only the leading `rotary_dim` of each head).

LongRoPE switches from the short to the long factors past `original_max_position_embeddings`.
Here each token decides by its own position, so a sequence's keys never depend on what it was
batched with (vLLM instead switches a whole batch once any of its positions is past). This equals
transformers' model run through its cache within the original context and after it; transformers'
`generate` differs past it: it drops its cache when a sequence crosses and recomputes every
position with the long factors, as it does for a prompt longer than the original context.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling


@dataclasses.dataclass(frozen=True)
class Rope:
    """What `apply_rope` needs, computed on the host and baked into the program."""

    inv_freq: np.ndarray                    # [rotary_dim // 2] float32
    long_inv_freq: np.ndarray | None = None  # LongRoPE: for positions >= long_from
    long_from: int = 0
    attention_factor: float = 1.0           # LongRoPE scales cos and sin by it


def rope_for(cfg: ModelConfig) -> Rope:
    dim = cfg.rotary_dim or cfg.head_dim
    s = cfg.rope_scaling
    if s is None or s.kind != "longrope":
        return Rope(inverse_frequencies(dim, cfg.rope_theta, s))
    base = inverse_frequencies(dim, cfg.rope_theta, None)
    for name, factors in (("short_factor", s.short_factor), ("long_factor", s.long_factor)):
        if len(factors) != dim // 2:
            raise ValueError(f"rope_scaling {name} has {len(factors)} entries; rotary dim {dim} needs {dim // 2}")
    return Rope(base / np.asarray(s.short_factor, np.float32), base / np.asarray(s.long_factor, np.float32),
                s.original_max_position_embeddings, s.attention_factor)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The `head_dim // 2` rotation frequencies, float32 (computed on the host, baked into the program)."""
    # float32 throughout, as transformers computes it, so positions far out still match.
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
    if scaling is not None and scaling.kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    if scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / np.float32(scaling.factor)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope) -> jax.Array:
    """Rotates the leading `2 * len(rope.inv_freq)` dims of `x` [T, heads, head_dim] by the angles
    of `positions` [T]; the rest pass through."""
    pos = positions.astype(jnp.float32)[:, None]
    angles = pos * jnp.asarray(rope.inv_freq)[None, :]
    if rope.long_inv_freq is not None:
        angles = jnp.where(positions[:, None] >= rope.long_from, pos * jnp.asarray(rope.long_inv_freq)[None, :], angles)
    both = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(both)[:, None, :], jnp.sin(both)[:, None, :]
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    dim = both.shape[-1]
    x32, rest = x[..., :dim].astype(jnp.float32), x[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = (x32 * cos + rotated * sin).astype(x.dtype)
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)
