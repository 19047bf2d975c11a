"""GPU (Pallas Triton) kernels: ragged paged attention and the KV write.

Attention.
  grid          (num_rows // R, kv_heads): one program per block of R query rows of one KV head
                (row layout of `kernel.to_rows`; R a power of two >= 16, as Triton's dot wants)
  operands      block_tables [S, pages_per_seq], kv_lens [S], cu_q_lens [S + 1], num_seqs [1],
                layer [1] as ordinary int32 arrays; q/out blocks [R, D]; the K/V pool whole,
                [layers, kv_heads, num_pages, page_size, D], read in place
A program loops over the sequences owning a row of its block; for each, over KV blocks of C
tokens (C a power of two, independent of the page size): the C keys' pages come from one gather
of the block table, then one gathered load per pool fetches [C, D] (row i from
pool[layer, head, page(i), offset(i)]). The online softmax state lives in registers.

KV write: grid (T // B, kv_heads); each program loads B tokens' [B, D] rows of one head and
scatters them to pool[layer, head, page, offset] (masked past T); the pools are aliased to the
outputs, so the update is in place under donation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import kernel


def _attention_kernel(tables_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref, layer_ref, q_ref,
                      k_ref, v_ref, out_ref, *, group, block_keys, sm_scale):
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
            pages = tables_ref[seq, jnp.minimum(keys // page_size, last_page)][:, None]
            offsets = (keys % page_size)[:, None]
            # Keys past kv_len load nothing: no bandwidth, and table entries there never matter.
            # Every index an array, none a slice: the form interpret mode can gather masked.
            mask = jnp.broadcast_to(key_valid, (block_keys, head_dim))
            load = lambda ref: plgpu.load(ref.at[layer, head, pages, offsets, lanes], mask=mask, other=0)
            k, v = load(k_ref), load(v_ref)
            valid = kernel.visible_mask(row, first_key + block_key, group=group, q_start=q_start,
                                        q_end=q_end, kv_len=kv_len, row_offset_tokens=0)
            return kernel.online_softmax_step(q, k, v, valid, key_valid, *state, sm_scale=sm_scale)
        return step

    def visit_sequence(seq, state):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]

        def attend(state):
            kv_len = kv_lens_ref[seq]
            block_last = jnp.minimum(q_end - 1, last_token)
            keys = jnp.clip(kv_len - (q_end - q_start) + (block_last - q_start) + 1, 0, kv_len)
            num_blocks = (keys + block_keys - 1) // block_keys
            return jax.lax.fori_loop(0, num_blocks, kv_step(seq, q_start, q_end, kv_len), state)

        overlaps = (q_start <= last_token) & (q_end > first_token)
        return jax.lax.cond(overlaps, attend, lambda state: state, state)

    state = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_seqs_ref[0], visit_sequence, state)
    out_ref[...] = kernel.finish(l, acc, out_ref.dtype)


def attention(q_rows, k_pages, v_pages, layer, block_tables, kv_lens, cu_q_lens, num_seqs, *,
              group, block_rows, kv_block_tokens, sm_scale, num_warps, num_stages, interpret):
    """q_rows [kv_heads, rows, D] (rows a multiple of block_rows) -> out rows, same shape."""
    kv_heads, num_rows, head_dim = q_rows.shape
    whole = pl.no_block_spec
    row_block = pl.BlockSpec((None, block_rows, head_dim), lambda i, h: (h, i, 0))
    body = functools.partial(_attention_kernel, group=group, block_keys=kv_block_tokens,
                             sm_scale=sm_scale)
    return pl.pallas_call(
        body,
        grid=(num_rows // block_rows, kv_heads),
        in_specs=[whole] * 5 + [row_block, whole, whole],
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),  # Triton
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(block_tables, kv_lens, cu_q_lens, num_seqs, layer, q_rows, k_pages, v_pages)


def _write_kernel(layer_ref, slots_ref, k_ref, v_ref, k_pool_in, v_pool_in, k_pool, v_pool, *,
                  num_tokens, block_tokens):
    del k_pool_in, v_pool_in  # aliased to k_pool, v_pool
    page_size, head_dim = k_pool.shape[3], k_pool.shape[4]
    head = pl.program_id(1)
    layer = layer_ref[0]
    tokens = pl.ds(pl.program_id(0) * block_tokens, block_tokens)
    token = pl.program_id(0) * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    in_range = jnp.broadcast_to((token < num_tokens)[:, None], (block_tokens, head_dim))
    slots = slots_ref[tokens][:, None]
    pages, offsets = slots // page_size, slots % page_size
    # Every index an array, none a slice: the form both Triton and interpret mode can scatter to.
    lanes = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    for new_ref, pool in ((k_ref, k_pool), (v_ref, v_pool)):
        plgpu.store(pool.at[layer, head, pages, offsets, lanes], new_ref[tokens, head, :], mask=in_range)


def write_kv(k_pages, v_pages, k, v, layer, slot_mapping, *, block_tokens, num_warps, interpret):
    """k/v [T, kv_heads, D] into pool[layer, :, page, offset]; returns the (aliased) pools."""
    num_tokens, kv_heads, _ = k.shape
    block_tokens = min(block_tokens, max(16, pl.next_power_of_2(num_tokens)))
    padded = pl.cdiv(num_tokens, block_tokens) * block_tokens
    pad = lambda x: jnp.pad(x.astype(k_pages.dtype), ((0, padded - num_tokens), (0, 0), (0, 0)))
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_write_kernel, num_tokens=num_tokens, block_tokens=block_tokens),
        grid=(padded // block_tokens, kv_heads),
        in_specs=[whole] * 6,
        out_specs=[whole] * 2,
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={4: 0, 5: 1},  # operands: layer, slots, k, v, k_pages, v_pages
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),  # Triton, not Mosaic GPU
        interpret=interpret,
        name="write_kv_gpu",
    )(layer, jnp.pad(slot_mapping, (0, padded - num_tokens)), pad(k), pad(v), k_pages, v_pages)
