"""GPU (Pallas Triton) kernels: ragged paged attention and the KV write.

Attention.
  grid          (num_rows // R, kv_heads): one program per block of R query rows of one KV head
                (row layout of `kernel.to_rows`; R a power of two >= 16, as Triton's dot wants)
  operands      block_tables [S, pages_per_seq], kv_lens [S], cu_q_lens [S + 1], num_seqs [1],
                layer [1] as ordinary int32 arrays; q/out blocks [R, D]; the K/V pool whole,
                [layers, kv_heads, num_pages, page_size, D], read in place, and for int8 pools
                its scales [layers, kv_heads, num_pages, page_size] float32, likewise
A program loops over the sequences owning a row of its block; for each, over KV blocks of C
tokens (C a power of two, independent of the page size): the C keys' pages come from one gather
of the block table, then one gathered load per pool fetches [C, D] (row i from
pool[layer, head, page(i), offset(i)]), and one per scale pool the keys' scales as a [1, C] row.
The online softmax state lives in registers. With a sliding window W the KV loop starts at the
block holding key `first position - W + 1` (the earliest of the program's tokens in the
sequence): blocks wholly before every row's window are never loaded.

KV write: grid (T // B, kv_heads); each program loads B tokens' [B, D] rows of one head (and
their [B] scales) and scatters them to pool[layer, head, page, offset] (masked past T); the pools
are aliased to the outputs, so the update is in place under donation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import kernel


def _attention_kernel(tables_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref, layer_ref, q_ref,
                      *refs, group, block_keys, sm_scale, sliding_window, softcap):
    # refs: k, v[, k_scale, v_scale], out.
    (k_ref, v_ref), scale_refs, out_ref = refs[:2], refs[2:-1], refs[-1]
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[3]
    last_page = tables_ref.shape[1] - 1
    first_row = pl.program_id(0) * rows
    head = pl.program_id(1)
    layer = layer_ref[0]
    first_token = first_row // group
    last_token = (first_row + rows - 1) // group
    q = q_ref[...]
    row = first_row + jax.lax.broadcasted_iota(jnp.int32, (rows, block_keys), 0)
    block_key = jax.lax.broadcasted_iota(jnp.int32, (rows, block_keys), 1)
    key_in_block = jnp.arange(block_keys, dtype=jnp.int32)
    lanes = jnp.arange(head_dim, dtype=jnp.int32)[None, :]

    def kv_step(seq, q_start, q_end, kv_len):
        def step(kv_block, state):
            first_key = kv_block * block_keys
            keys = first_key + key_in_block
            key_valid = (keys < kv_len)[:, None]
            pages = tables_ref[seq, jnp.minimum(keys // page_size, last_page)]
            offsets = keys % page_size
            # Keys past kv_len load nothing: no bandwidth, and table entries there never matter.
            # Every index an array, none a slice: the form interpret mode can gather masked.
            mask = jnp.broadcast_to(key_valid, (block_keys, head_dim))
            # `other` in the pool's dtype: Triton's lowering cannot cast an int 0 to float8.
            load = lambda ref: plgpu.load(ref.at[layer, head, pages[:, None], offsets[:, None], lanes],
                                          mask=mask, other=jnp.zeros((), ref.dtype))
            k, v = load(k_ref), load(v_ref)
            # Scales as [1, C] rows, along the keys like the scores they multiply.
            scales = {name: plgpu.load(ref.at[layer, head, pages[None, :], offsets[None, :]],
                                       mask=(keys < kv_len)[None, :], other=0.0)
                      for name, ref in zip(("k_scale", "v_scale"), scale_refs)}
            valid = kernel.visible_mask(row, first_key + block_key, group=group, q_start=q_start,
                                        q_end=q_end, kv_len=kv_len, row_offset_tokens=0,
                                        sliding_window=sliding_window)
            return kernel.online_softmax_step(q, k, v, valid, key_valid, *state, sm_scale=sm_scale,
                                              softcap=softcap, **scales)
        return step

    def visit_sequence(seq, state):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]

        def attend(state):
            kv_len = kv_lens_ref[seq]
            offset = kv_len - (q_end - q_start) - q_start  # position = token + offset
            keys = jnp.clip(jnp.minimum(q_end - 1, last_token) + offset + 1, 0, kv_len)
            num_blocks = (keys + block_keys - 1) // block_keys
            first_block = kernel.first_visible_block(jnp.maximum(q_start, first_token) + offset,
                                                     block_keys, sliding_window)
            return jax.lax.fori_loop(first_block, num_blocks, kv_step(seq, q_start, q_end, kv_len),
                                     state)

        overlaps = (q_start <= last_token) & (q_end > first_token)
        return jax.lax.cond(overlaps, attend, lambda state: state, state)

    state = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_seqs_ref[0], visit_sequence, state)
    out_ref[...] = kernel.finish(l, acc, out_ref.dtype)


def attention(q_rows, k_pages, v_pages, layer, block_tables, kv_lens, cu_q_lens, num_seqs,
              k_scale=None, v_scale=None, *, group, block_rows, kv_block_tokens, sm_scale, num_warps,
              num_stages, interpret, sliding_window=None, softcap=None):
    """q_rows [kv_heads, rows, D] (rows a multiple of block_rows) -> out rows, same shape.
    k/v_scale: the int8 pool's scales, or None. sliding_window: static int, or None (causal).
    softcap: static float, or None (scores as they are)."""
    kv_heads, num_rows, head_dim = q_rows.shape
    pools = [k_pages, v_pages] + ([k_scale, v_scale] if k_scale is not None else [])
    whole = pl.no_block_spec
    row_block = pl.BlockSpec((None, block_rows, head_dim), lambda i, h: (h, i, 0))
    body = functools.partial(_attention_kernel, group=group, block_keys=kv_block_tokens,
                             sm_scale=sm_scale, sliding_window=sliding_window, softcap=softcap)
    return pl.pallas_call(
        body,
        grid=(num_rows // block_rows, kv_heads),
        in_specs=[whole] * 5 + [row_block] + [whole] * len(pools),
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),  # Triton
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(block_tables, kv_lens, cu_q_lens, num_seqs, layer, q_rows, *pools)


def _write_kernel(layer_ref, slots_ref, *refs, num_pools, num_tokens, block_tokens):
    # refs: the new rows (k, v[, k_scale, v_scale]), the pools in (aliased to the pools out, so
    # unused), the pools out.
    new_rows, pools = refs[:num_pools], refs[2 * num_pools:]
    page_size, head_dim = pools[0].shape[3], pools[0].shape[4]
    head = pl.program_id(1)
    layer = layer_ref[0]
    tokens = pl.ds(pl.program_id(0) * block_tokens, block_tokens)
    token = pl.program_id(0) * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    in_range = token < num_tokens
    slots = slots_ref[tokens]
    pages, offsets = slots // page_size, slots % page_size
    # Every index an array, none a slice: the form both Triton and interpret mode can scatter to.
    lanes = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    for new_ref, pool in zip(new_rows, pools):
        if pool.ndim == 5:   # values: [B, D] a program
            plgpu.store(pool.at[layer, head, pages[:, None], offsets[:, None], lanes],
                        new_ref[tokens, head, :],
                        mask=jnp.broadcast_to(in_range[:, None], (block_tokens, head_dim)))
        else:                # scales: [B]
            plgpu.store(pool.at[layer, head, pages, offsets], new_ref[tokens, head], mask=in_range)


def write_kv(pools, new_rows, layer, slot_mapping, *, block_tokens, num_warps, interpret):
    """new_rows (k, v [T, kv_heads, D] in the pools' dtype[, k_scale, v_scale [T, kv_heads]]) into
    pools (k_pages, v_pages[, k_scale, v_scale]) at [layer, :, page, offset]; returns the
    (aliased) pools."""
    num_tokens, kv_heads, _ = new_rows[0].shape
    n = len(pools)
    block_tokens = min(block_tokens, max(16, pl.next_power_of_2(num_tokens)))
    padded = pl.cdiv(num_tokens, block_tokens) * block_tokens
    pad = lambda x: jnp.pad(x, ((0, padded - num_tokens),) + ((0, 0),) * (x.ndim - 1))
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_write_kernel, num_pools=n, num_tokens=num_tokens, block_tokens=block_tokens),
        grid=(padded // block_tokens, kv_heads),
        in_specs=[whole] * (2 + 2 * n),
        out_specs=[whole] * n,
        out_shape=tuple(jax.ShapeDtypeStruct(pool.shape, pool.dtype) for pool in pools),
        input_output_aliases={2 + n + i: i for i in range(n)},  # operands: layer, slots, rows, pools
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),  # Triton, not Mosaic GPU
        interpret=interpret,
        name="write_kv_gpu",
    )(layer, jnp.pad(slot_mapping, (0, padded - num_tokens)), *map(pad, new_rows), *pools)
