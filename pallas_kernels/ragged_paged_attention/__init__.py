"""Ragged paged attention over the engine's KV pool, as Pallas kernels for TPU and GPU.

One call attends every new token of a ragged batch (decodes and prefill chunks mixed) to its own
sequence's pages of one layer of the pool:

  q             [T, heads, head_dim]      sequence s owns q[cu_q_lens[s]:cu_q_lens[s + 1]]
  k/v_pages     [layers, kv_heads, num_pages, page_size, head_dim]   the whole pool, head-major
  layer         int32 scalar or [1]       traced; the kernels index the pool with it in place
  block_tables  [S, pages_per_seq] int32  each sequence's pages in order; entries past its last
                                          page may point anywhere (page 0) and never matter
  kv_lens       [S] int32                 context length including the new tokens (already written)
  cu_q_lens     [S + 1] int32             cumulative query starts
  num_seqs      [1] int32                 rows s >= num_seqs[0] are unused
  k/v_scale     [layers, kv_heads, num_pages, page_size] float32, int8 pools only (else None)

The pool holds q's dtype, or a narrow one (`quantize_kv`): int8 with a scale per token and KV
head (read as value * scale), or float8_e4m3fn with one implicit scale of 1.

Query i of sequence s sits at position kv_len - q_len + i and sees keys 0..position. Rows with
kv_len < q_len are legal (negative positions see nothing); tokens at or past
cu_q_lens[num_seqs[0]] are padding; both come out 0. Softmax in float32 with an online update
over blocks of pages; the output is in q.dtype.

Sliding window: the static keyword `sliding_window` (None or 0: full causal attention; else an
int >= 1, as Hugging Face's Mistral and Gemma define it) limits the query at position p to keys
p - sliding_window < j <= p. The kernels then start each sequence's KV loop at the first block
any row of the query block can see, so pages wholly before the window are never read and a
long context costs no more than the window.

Soft-capping: the static keyword `softcap` (None, or c > 0) turns each scaled score s into
c * tanh(s / c) before the mask and the softmax, as Gemma 2's `attn_logit_softcapping` does.

Variants: `tpu.py` (Mosaic: scalar prefetch, K/V in HBM, pages DMA'd into VMEM) and `gpu.py`
(Triton: gathered page loads). Both run on CPU with interpret=True. `kernel.py` holds what they
share, `reference.py` the plain-jnp specification, `tuning.py` block sizes per device kind.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import gpu, kernel, tpu
from pallas_kernels.ragged_paged_attention.reference import (
    FP8_MAX, NARROW_DTYPES, check_sliding_window, check_softcap, quantize_kv, ragged_paged_attention_reference,
    write_kv_reference)
from pallas_kernels.ragged_paged_attention.tuning import Tuning, tuning_for

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "write_kv",
           "write_kv_reference", "quantize_kv", "FP8_MAX", "NARROW_DTYPES", "Tuning", "tuning_for"]

PLATFORMS = ("tpu", "gpu")


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _tpu_block_tokens(wanted: int, tokens: int, group: int, dtype) -> int:
    """At most `wanted` (or all) tokens, rounded up so the rows fill whole sublane tiles."""
    sublanes = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    unit = sublanes // math.gcd(sublanes, group)
    return _round_up(min(wanted, tokens), unit)


def _resolve(platform, interpret, tuning):
    """(platform, interpret, tuning) with the defaults filled in from the backend."""
    backend = jax.default_backend()
    if platform is None:
        platform = "gpu" if backend == "gpu" else "tpu"
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} must be one of {PLATFORMS} or None")
    if interpret is None:
        interpret = backend == "cpu"
    return platform, interpret, tuning if tuning is not None else tuning_for()


def _check_pool_dtype(k_pages, v_pages, compute_dtype):
    """Attention reads pages of the compute dtype or of a narrow one."""
    allowed = (jnp.dtype(compute_dtype).name,) + tuple(d.name for d in NARROW_DTYPES)
    if k_pages.dtype != v_pages.dtype or k_pages.dtype.name not in allowed:
        raise ValueError(f"k_pages and v_pages must share one dtype of {allowed}, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")


def _check_scales(k_pages, k_scale, v_scale):
    """Scales come with int8 pools and only with them, shaped like the pool without head_dim."""
    scaled = k_pages.dtype == jnp.int8
    if (k_scale is None) != (v_scale is None) or (k_scale is not None) != scaled:
        raise ValueError(f"k_scale and v_scale must both be given for an int8 pool and only then; "
                         f"pool {k_pages.dtype}, k_scale {'None' if k_scale is None else 'given'}, "
                         f"v_scale {'None' if v_scale is None else 'given'}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and (scale.shape != k_pages.shape[:4] or scale.dtype != jnp.float32):
            raise ValueError(f"{name} must be float32 {k_pages.shape[:4]} (the pool's shape without "
                             f"head_dim), got {scale.dtype} {scale.shape}")


def _check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs):
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [layers, kv_heads, num_pages, page_size, "
                         f"head_dim], got {k_pages.shape} and {v_pages.shape}")
    heads, head_dim = q.shape[1:]
    kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if k_pages.shape[4] != head_dim:
        raise ValueError(f"the pool's head_dim={k_pages.shape[4]} must equal q's head_dim={head_dim}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [seqs, pages_per_seq], got shape {block_tables.shape}")
    seqs = block_tables.shape[0]
    expected = {"kv_lens": (kv_lens, (seqs,)), "cu_q_lens": (cu_q_lens, (seqs + 1,)),
                "num_seqs": (num_seqs, (1,))}
    for name, (array, shape) in expected.items():
        if array.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (block_tables has {seqs} rows), "
                             f"got {array.shape}")
    arrays = {"block_tables": block_tables, "kv_lens": kv_lens, "cu_q_lens": cu_q_lens,
              "num_seqs": num_seqs}
    for name, array in arrays.items():
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "softcap", "platform", "tuning",
                                              "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, layer, block_tables, kv_lens, cu_q_lens, num_seqs,
                           k_scale=None, v_scale=None, *, sm_scale=None, sliding_window=None,
                           softcap=None, platform=None, tuning=None, interpret=None):
    """out [T, heads, head_dim] in q.dtype: each token attends causally to its sequence's pages.

    k/v_scale: the scales of an int8 pool (None for any other dtype).
    sliding_window: None or 0 for full causal attention, else an int >= 1: the query at position
      p sees key j iff p - sliding_window < j <= p (and j < kv_len).
    softcap: None, or c > 0: each scaled score s becomes c * tanh(s / c) before the mask and the
      softmax (Gemma 2's attention logit soft-capping).

    platform: "tpu" | "gpu" | None (from the backend; CPU runs the TPU kernel interpreted).
    interpret: None means True on CPU, False elsewhere; a `pltpu.InterpretParams` runs the TPU
      kernel in the slower TPU simulator. tuning: a `Tuning` (default: `tuning_for()`).
    """
    _check_shapes(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs)
    _check_pool_dtype(k_pages, v_pages, q.dtype)
    _check_scales(k_pages, k_scale, v_scale)
    # A window as wide as the table's capacity masks nothing: compile the causal kernel.
    sliding_window = check_sliding_window(sliding_window, block_tables.shape[1] * k_pages.shape[3])
    softcap = check_softcap(softcap)
    platform, interpret, tuning = _resolve(platform, interpret, tuning)
    tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[1]
    group = heads // kv_heads
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    metadata = (layer, block_tables, kv_lens, cu_q_lens, num_seqs)
    decode_like = tokens <= 2 * block_tables.shape[0]
    if platform == "tpu":
        block_tokens = _tpu_block_tokens(tuning.decode_q_block_tokens if decode_like
                                         else tuning.q_block_tokens, tokens, group, q.dtype)
        heads_per_block = tuning.kv_heads_per_block or kv_heads
        if kv_heads % heads_per_block:
            raise ValueError(f"kv_heads_per_block={heads_per_block} must divide kv_heads={kv_heads}")
        rows = kernel.to_rows(q, kv_heads, _round_up(tokens, block_tokens) * group)
        out = tpu.attention(rows, k_pages, v_pages, *metadata, k_scale, v_scale, group=group,
                            block_tokens=block_tokens, kv_block_tokens=tuning.kv_block_tokens,
                            kv_heads_per_block=heads_per_block, sm_scale=sm_scale,
                            interpret=interpret, sliding_window=sliding_window, softcap=softcap)
    else:
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the GPU kernel")
        block_rows = tuning.gpu_decode_block_rows if decode_like else tuning.gpu_block_rows
        block_rows = min(block_rows, max(16, _next_power_of_2(tokens * group)))
        rows = kernel.to_rows(q, kv_heads, _round_up(tokens * group, block_rows))
        out = gpu.attention(rows, k_pages, v_pages, *metadata, k_scale, v_scale,
                            group=group, block_rows=block_rows, kv_block_tokens=tuning.kv_block_tokens,
                            sm_scale=sm_scale, num_warps=tuning.gpu_num_warps,
                            num_stages=tuning.gpu_num_stages, interpret=interpret,
                            sliding_window=sliding_window, softcap=softcap)
    return kernel.from_rows(out, tokens, heads)


@functools.partial(jax.jit, static_argnames=("platform", "tuning", "interpret"))
def write_kv(k_pages, v_pages, k, v, layer, slot_mapping, k_scale=None, v_scale=None, *,
             platform=None, tuning=None, interpret=None):
    """(k_pages, v_pages) with k/v [T, kv_heads, head_dim] written at pool[layer, :, page, offset],
    quantized to the pool's dtype as `quantize_kv` does; for an int8 pool k/v_scale are given and
    come back updated after the pools: (k_pages, v_pages, k_scale, v_scale).

    slot_mapping [T] int32 = page * page_size + offset (padding tokens point into page 0). The
    pools are aliased to the outputs: donate them and the update is in place.
    """
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (k_pages.shape[1], k_pages.shape[4]):
        raise ValueError(f"k and v must be [tokens, kv_heads={k_pages.shape[1]}, "
                         f"head_dim={k_pages.shape[4]}], got {k.shape} and {v.shape}")
    if slot_mapping.shape != k.shape[:1] or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{slot_mapping.shape}")
    _check_scales(k_pages, k_scale, v_scale)
    platform, interpret, tuning = _resolve(platform, interpret, tuning)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    # Quantized here, elementwise over the new rows only: the kernels just move bytes.
    (k, k_new_scale), (v, v_new_scale) = quantize_kv(k, k_pages.dtype), quantize_kv(v, v_pages.dtype)
    pools, rows = (k_pages, v_pages), (k, v)
    if k_scale is not None:
        pools, rows = pools + (k_scale, v_scale), rows + (k_new_scale, v_new_scale)
    if platform == "tpu":
        return tpu.write_kv(pools, rows, layer, slot_mapping, interpret=interpret)
    return gpu.write_kv(pools, rows, layer, slot_mapping, block_tokens=tuning.write_block_tokens,
                        num_warps=tuning.gpu_num_warps, interpret=interpret)
