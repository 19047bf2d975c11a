"""What the TPU and GPU kernels share: the query-row layout, the mask and the online softmax.

Query rows. The wrappers hand a kernel q as `[kv_heads, rows, head_dim]` with
`row = token * group + g` (group = heads // kv_heads): each KV head's queries, every token's
`group` heads side by side. One block of rows then multiplies one KV block with a single 2-D
matmul whatever the GQA ratio, and a row's token needs no division: `token >= a` exactly when
`row >= a * group`.

Mask. Row r of sequence s (tokens cu_q_lens[s]:cu_q_lens[s + 1]) sits at position
`kv_len - q_len + (token - q_start)` and sees key k iff the row belongs to s, `k < kv_len` and
`k <= position`; the last is `row >= (k + q_len - kv_len + q_start) * group`. A sliding window
W adds `k > position - W`, i.e. `row < (k + W + q_len - kv_len + q_start) * group`.

Online softmax. Per row, a running max m, denominator l and accumulator acc (float32). A block
whose row sees nothing leaves the row untouched; a row that saw nothing ends as 0, never NaN.

Narrow pools. int8 and float8_e4m3fn values are exact in every float compute dtype, so a block is
converted (through float32) to q's dtype and the matmuls stay there. int8's per-key scales
multiply the scores' columns (q . k * scale_k) and the probabilities' columns before P @ V
(p * scale_v): the same as scaling K's and V's rows, but a scale block is a row vector [1, C]
along the lanes, like the scores, so no kernel ever moves it across the lanes/sublanes boundary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_rows(q: jax.Array, kv_heads: int, num_rows: int) -> jax.Array:
    """q [T, heads, D] -> [kv_heads, num_rows, D], rows token-major, zero-padded past T * group."""
    tokens, heads, head_dim = q.shape
    group = heads // kv_heads
    rows = q.reshape(tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    rows = rows.reshape(kv_heads, tokens * group, head_dim)
    return jnp.pad(rows, ((0, 0), (0, num_rows - tokens * group), (0, 0)))


def from_rows(rows: jax.Array, num_tokens: int, heads: int) -> jax.Array:
    """Inverse of `to_rows`: [kv_heads, num_rows, D] -> [T, heads, D]."""
    kv_heads, _, head_dim = rows.shape
    group = heads // kv_heads
    out = rows[:, :num_tokens * group].reshape(kv_heads, num_tokens, group, head_dim)
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, heads, head_dim)


def visible_mask(row, key, *, group, q_start, q_end, kv_len, row_offset_tokens,
                 sliding_window=None):
    """bool [rows, keys]: which (row, key) pairs of one sequence attend.

    `row` and `key` are int32 index arrays broadcast to [rows, keys] (row numbering starts at the
    block's first token `row_offset_tokens`, keys at 0 of the sequence). sliding_window (static
    int, or None for full causal attention): a row at position p sees only keys > p - window.
    """
    q_len = q_end - q_start
    first = (q_start - row_offset_tokens) * group
    end = (q_end - row_offset_tokens) * group
    diagonal = key + q_len - kv_len + q_start - row_offset_tokens  # the token whose position is key
    mask = (row >= first) & (row < end) & (key < kv_len) & (row >= diagonal * group)
    if sliding_window:
        mask &= row < (diagonal + sliding_window) * group
    return mask


def first_visible_block(position, block_keys: int, sliding_window=None):
    """The first KV block of `block_keys` keys that a row at `position` (or later) can see: 0
    without a window; blocks wholly before `position - window + 1` are never needed."""
    if not sliding_window:
        return jnp.int32(0)
    return jax.lax.div(jnp.maximum(position - sliding_window + 1, 0), jnp.int32(block_keys))


def widen(block, dtype):
    """A K/V block in the pool's dtype -> `dtype` (q's), exactly for int8 and float8 values."""
    if block.dtype == dtype:
        return block
    return block.astype(jnp.float32).astype(dtype)


def online_softmax_step(q, k, v, valid, key_valid, m, l, acc, *, sm_scale, k_scale=None,
                        v_scale=None, softcap=None):
    """One KV block folded into (m [R, 1], l [R, 1], acc [R, D]); returns the new triple.

    q [R, D], k/v [C, D] in their storage dtype; valid [R, C]; key_valid [C, 1] zeroes V rows that
    hold junk (stale buffers, or the unwritten tail of a page), so 0 * NaN never reaches acc.
    k/v_scale [1, C] float32 (int8 pools): the block's per-key scales, junk where keys are not
    valid.
    """
    k, v = widen(k, q.dtype), widen(v, q.dtype)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale
    if k_scale is not None:
        s = s * k_scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    v = jnp.where(key_valid, v, jnp.zeros_like(v))
    weights = p if v_scale is None else jnp.where(valid, p * v_scale, 0.0)  # junk scales: 0 * NaN
    pv = jax.lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def finish(l, acc, dtype):
    """acc / l, and 0 for rows that saw no key."""
    seen = l > 0
    return jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0).astype(dtype)
