"""Ragged paged attention in plain `jnp`: the specification the Pallas kernels are tested against.

Inputs (see `ragged_paged_attention` for the full contract):
  q             [T, heads, head_dim]    queries of every new token, packed by sequence
  k/v_pages     [layers, kv_heads, num_pages, page_size, head_dim]   the whole pool
  layer         int32 scalar (or [1])   the layer to read
  block_tables  [S, pages_per_seq] int32
  kv_lens       [S] int32               context length, new tokens included
  cu_q_lens     [S + 1] int32           sequence s owns tokens cu_q_lens[s]:cu_q_lens[s + 1]
  num_seqs      [1] int32               rows s >= num_seqs[0] are junk
  k/v_scale     [layers, kv_heads, num_pages, page_size] float32, int8 pools only (else None)

Algorithm: each token finds its sequence, hence its position and the keys it sees: up to
`min(position + 1, kv_len)` (none for padding), and from `position - sliding_window + 1` with a
window. A scan over the table's columns, a few pages a step, gathers every token's pages straight
from the pool (never a whole layer) and folds them into an online softmax in float32, so memory is
O(tokens x pages per step), not O(tokens x context). Each token's scan starts at the step holding
its first visible key, so with a window the scan takes `(window - 1) // keys_per_step + 2` steps
at most, however long the contexts.

Narrow pools (`quantize_kv`): int8 values with a float32 scale per token and KV head, read as
value * scale; float8_e4m3fn values with one implicit scale of 1 (clipped to +-448 on write).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

_TOKENS_PER_STEP = 64  # keys gathered per token and scan step


def check_softcap(softcap):
    """None, or a float > 0 (static): the soft-capping of the scores."""
    if softcap is not None and not (isinstance(softcap, numbers.Real) and softcap > 0):
        raise ValueError(f"softcap={softcap!r} must be None or a number > 0")
    return None if softcap is None else float(softcap)


def check_sliding_window(sliding_window, max_keys: int | None = None):
    """The window as the kernels take it: None for full causal attention (None, 0, or a window
    covering all `max_keys` keys a table can hold), else the int; ValueError otherwise."""
    integer = isinstance(sliding_window, numbers.Integral) and not isinstance(sliding_window, bool)
    if sliding_window is not None and (not integer or sliding_window < 0):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or 0 (full causal "
                         "attention) or an int >= 1")
    if not sliding_window or (max_keys is not None and sliding_window >= max_keys):
        return None
    return int(sliding_window)


def visible_keys(cu_q_lens, kv_lens, num_seqs, num_tokens: int):
    """(sequence [T], keys visible [T]) per packed token; padding sees 0 keys."""
    seq, _, visible = visible_range(cu_q_lens, kv_lens, num_seqs, num_tokens)
    return seq, visible


def visible_range(cu_q_lens, kv_lens, num_seqs, num_tokens: int, sliding_window=None):
    """(sequence [T], first visible key [T], end [T]) per packed token: token t sees keys
    first[t] <= key < end[t]; padding sees none (first = end = 0)."""
    num_rows = kv_lens.shape[0]
    n = num_seqs.reshape(())
    # Rows past num_seqs are junk: collapse them onto the batch's end so the starts stay sorted.
    cu = jnp.where(jnp.arange(num_rows + 1) <= n, cu_q_lens, cu_q_lens[n])
    token = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu, token, side="right") - 1, 0, num_rows - 1)
    in_batch = (token >= cu[0]) & (token < cu[n])
    q_len = cu[seq + 1] - cu[seq]
    position = kv_lens[seq] - q_len + (token - cu[seq])
    visible = jnp.where(in_batch, jnp.clip(position + 1, 0, kv_lens[seq]), 0)
    if not sliding_window:
        return seq, jnp.zeros_like(visible), visible
    return seq, jnp.clip(position - sliding_window + 1, 0, visible), visible


def ragged_paged_attention_reference(q, k_pages, v_pages, layer, block_tables, kv_lens, cu_q_lens,
                                     num_seqs, k_scale=None, v_scale=None, *, sm_scale=None,
                                     sliding_window=None, softcap=None, platform=None, tuning=None,
                                     interpret=None):
    """out [T, heads, head_dim] in q.dtype; `platform`, `tuning`, `interpret` are ignored.

    sliding_window: None or 0 for full causal attention, else an int >= 1: the query at position
    p sees key j iff p - sliding_window < j <= p (and j < kv_len).
    softcap: None, or c > 0: each score s (scaled) becomes c * tanh(s / c) (Gemma 2's attention
    logit soft-capping).
    """
    del platform, tuning, interpret
    num_tokens, heads, head_dim = q.shape
    kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    group = heads // kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    table_width = block_tables.shape[1]
    sliding_window = check_sliding_window(sliding_window, table_width * page_size)
    softcap = check_softcap(softcap)

    seq, first, visible = visible_range(cu_q_lens, kv_lens, num_seqs, num_tokens, sliding_window)
    pages_per_step = max(1, _TOKENS_PER_STEP // page_size)
    keys_per_step = pages_per_step * page_size
    num_steps = -(-table_width // pages_per_step)
    if sliding_window:  # a token's keys [first, position] span this many steps at most
        num_steps = min(num_steps, (sliding_window - 1) // keys_per_step + 2)
    first_step = first // keys_per_step  # [T]
    token_tables = block_tables[seq]  # [T, pages_per_seq]
    qf = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim) * scale

    def gather(pool, scale, pages):  # pages [T, n] -> [T, kv_heads, n * page_size, head_dim] f32
        blocks = pool[layer, :, pages].astype(jnp.float32)  # [T, n, kv_heads, page_size, head_dim]
        if scale is not None:
            blocks = blocks * scale[layer, :, pages][..., None]
        return jnp.swapaxes(blocks, 1, 2).reshape(num_tokens, kv_heads, keys_per_step, head_dim)

    def step(carry, i):
        m, l, acc = carry
        column = (first_step + i)[:, None] * pages_per_step + jnp.arange(pages_per_step)  # [T, n]
        # Columns past the table hold keys >= its capacity >= kv_len: read page 0, masked below.
        pages = jnp.take_along_axis(token_tables, jnp.minimum(column, table_width - 1), axis=1)
        key = (first_step + i)[:, None] * keys_per_step + jnp.arange(keys_per_step)  # [T, C]
        valid = (key >= first[:, None]) & (key < visible[:, None])
        k = gather(k_pages, k_scale, pages)
        v = jnp.where(valid[:, None, :, None], gather(v_pages, v_scale, pages), 0.0)  # junk: inf/NaN
        s = jnp.einsum("tkgd,tkcd->tkgc", qf, k, precision=jax.lax.Precision.HIGHEST)
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        pv = jnp.einsum("tkgc,tkcd->tkgd", p, v, precision=jax.lax.Precision.HIGHEST)
        return (m_new, alpha * l + p.sum(axis=-1, keepdims=True), alpha * acc + pv), None

    init = (jnp.full((num_tokens, kv_heads, group, 1), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group, 1), jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(num_steps))
    out = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    return out.reshape(num_tokens, heads, head_dim).astype(q.dtype)


FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)   # 448
NARROW_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def quantize_kv(x, dtype):
    """x [T, kv_heads, head_dim] -> (values in the pool's `dtype`, scales [T, kv_heads] float32 for
    int8, else None). int8: symmetric over head_dim, so each token's row keeps its own range."""
    if dtype == jnp.int8:
        scale = jnp.maximum(jnp.abs(x).max(axis=-1).astype(jnp.float32), 1e-12) / 127
        return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale
    if dtype == jnp.float8_e4m3fn:
        return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(dtype), None  # the cast alone overflows to NaN
    return x.astype(dtype), None


def write_kv_reference(k_pages, v_pages, k, v, layer, slot_mapping, k_scale=None, v_scale=None):
    """The plain scatter: pool[layer, :, page, offset] = new row (quantized as `quantize_kv` does),
    for every token. Returns (k_pages, v_pages), and the scales after them when given."""
    page_size = k_pages.shape[3]
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    at = (layer, slice(None), pages, offsets)  # the update is [T, kv_heads, ...]: indices go first
    (k, k_new_scale), (v, v_new_scale) = quantize_kv(k, k_pages.dtype), quantize_kv(v, v_pages.dtype)
    out = (k_pages.at[at].set(k), v_pages.at[at].set(v))
    if k_scale is None:
        return out
    return out + (k_scale.at[at].set(k_new_scale), v_scale.at[at].set(v_new_scale))
