"""TPU (Mosaic) kernels: ragged paged attention and the KV write, K/V pool left in HBM.

Attention.
  grid          (kv_heads // hb, num_rows // R), both parallel; R = block tokens * group rows
                (block tokens from the tuning, rounded so R fills whole sublane tiles)
  scalar prefetch (SMEM)  layer [1], block_tables flattened [S * pages_per_seq], kv_lens [S],
                cu_q_lens [S + 1], num_seqs [1]
  q, out        VMEM blocks [hb, R, D] of the row layout (`kernel.to_rows`)
  k/v pool      HBM (`pl.ANY`) [layers, kv_heads, num_pages, page_size, D], never sliced outside
  k/v scales    int8 pools only: HBM [layers, kv_heads, num_pages, page_size] float32, paged
                like the pool: every page's scales travel with its values
  scratch       k/v buffers [2, hb, C, D] (two slots, C = pages_per_block * page_size), for int8
                pools k/v scale buffers [2, hb, C] float32 (keys along the lanes, as the scores
                hold them), DMA semaphores [pools (k, v[, k_scale, v_scale]), 2 (slot)],
                m/l [hb, R, 1] and acc [hb, R, D] in float32
A program loops over the sequences that own a token of its block; for each, over the KV blocks
its rows can see, copying the next block's pages (one DMA per page and pool, all hb heads at
once) into the other slot while it computes the current one. The loop ends at the causal bound
of the block's last token; with a sliding window W it starts at the block holding key
`first position - W + 1` (the block's earliest token in the sequence), so pages wholly before
every row's window are never copied. Slots count from the loop's first block (slot 0).

KV write: one program; a DMA per token and pool (HBM to HBM) puts the token's [kv_heads, 1, D]
row (for scales [kv_heads, 1]) at pool[layer, :, page, offset]; all start, then all are awaited.
The pools are aliased to the outputs, so the update is in place under donation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import kernel


def _cdiv(a, b: int):
    return jax.lax.div(a + (b - 1), b)


def _attention_kernel(layer_ref, tables_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,  # SMEM
                      q_ref, *refs, group, block_tokens, pages_per_block, pages_per_seq, sm_scale,
                      num_pools, sliding_window, softcap):
    # refs: the pools in HBM (k, v[, k_scale, v_scale]), out, their VMEM buffers, sems, m, l, acc.
    hbm, out_ref, bufs = refs[:num_pools], refs[num_pools], refs[num_pools + 1:2 * num_pools + 1]
    sems, m_ref, l_ref, acc_ref = refs[2 * num_pools + 1:]
    heads_per_block, rows, _ = q_ref.shape
    page_size = hbm[0].shape[3]
    block_keys = pages_per_block * page_size
    first_head = pl.program_id(0) * heads_per_block
    first_token = pl.program_id(1) * block_tokens
    layer = layer_ref[0]
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def page_copies(seq, kv_block, slot, num_pages, action):
        """Starts (or waits for) the DMAs of one KV block's pages into buffer `slot`."""
        first_page = kv_block * pages_per_block
        count = jnp.minimum(pages_per_block, num_pages - first_page)

        def one_page(j, _):
            page = tables_ref[seq * pages_per_seq + first_page + j]
            for kind, (pool, buf) in enumerate(zip(hbm, bufs)):  # [hb, page_size(, D)] each
                copy = pltpu.make_async_copy(
                    pool.at[layer, pl.ds(first_head, heads_per_block), page],
                    buf.at[slot, :, pl.ds(j * page_size, page_size)], sems.at[kind, slot])
                copy.start() if action == "start" else copy.wait()

        jax.lax.fori_loop(0, count, one_page, None)

    def attend(seq, q_start, q_end, kv_block, slot, keys):
        kv_len = kv_lens_ref[seq]
        shape = (rows, block_keys)
        key = kv_block * block_keys + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        valid = kernel.visible_mask(jax.lax.broadcasted_iota(jnp.int32, shape, 0), key, group=group,
                                    q_start=q_start, q_end=q_end, kv_len=kv_len,
                                    row_offset_tokens=first_token, sliding_window=sliding_window)
        # Only keys < `keys` (the block's causal bound, <= kv_len) were copied into this slot;
        # rows past them hold an earlier block's pages or uninitialised VMEM.
        key_valid = (kv_block * block_keys
                     + jax.lax.broadcasted_iota(jnp.int32, (block_keys, 1), 0)) < keys
        for h in range(heads_per_block):
            # Scales as [1, C] rows, read in the lane layout they were copied into.
            scales = {name: buf[slot, pl.ds(h, 1)]
                      for name, buf in zip(("k_scale", "v_scale"), bufs[2:])}
            m, l, acc = kernel.online_softmax_step(
                q_ref[h], bufs[0][slot, h], bufs[1][slot, h], valid, key_valid,
                m_ref[h], l_ref[h], acc_ref[h], sm_scale=sm_scale, softcap=softcap, **scales)
            m_ref[h], l_ref[h], acc_ref[h] = m, l, acc

    def visit_sequence(seq, _):
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        last_token = jnp.minimum(q_end, first_token + block_tokens) - 1

        @pl.when((q_start < first_token + block_tokens) & (q_end > first_token))
        def _():
            kv_len = kv_lens_ref[seq]
            offset = kv_len - (q_end - q_start) - q_start  # position = token + offset
            keys = jnp.clip(last_token + offset + 1, 0, kv_len)
            num_pages = _cdiv(keys, page_size)
            num_blocks = _cdiv(num_pages, pages_per_block)
            first_block = kernel.first_visible_block(jnp.maximum(q_start, first_token) + offset,
                                                     block_keys, sliding_window)

            @pl.when(first_block < num_blocks)
            def _():
                page_copies(seq, first_block, 0, num_pages, "start")

            def kv_step(kv_block, _):
                slot = jax.lax.rem(kv_block - first_block, 2)

                @pl.when(kv_block + 1 < num_blocks)
                def _():
                    page_copies(seq, kv_block + 1, 1 - slot, num_pages, "start")

                page_copies(seq, kv_block, slot, num_pages, "wait")
                attend(seq, q_start, q_end, kv_block, slot, keys)

            jax.lax.fori_loop(first_block, num_blocks, kv_step, None)

    jax.lax.fori_loop(0, num_seqs_ref[0], visit_sequence, None)
    for h in range(heads_per_block):
        out_ref[h] = kernel.finish(l_ref[h], acc_ref[h], out_ref.dtype)


def attention(q_rows, k_pages, v_pages, layer, block_tables, kv_lens, cu_q_lens, num_seqs,
              k_scale=None, v_scale=None, *, group, block_tokens, kv_block_tokens,
              kv_heads_per_block, sm_scale, interpret, sliding_window=None, softcap=None):
    """q_rows [kv_heads, rows, D] (rows a multiple of block_tokens * group) -> out rows, same shape.
    k/v_scale: the int8 pool's scales, or None. sliding_window: static int, or None (causal).
    softcap: static float, or None (scores as they are)."""
    kv_heads, num_rows, head_dim = q_rows.shape
    page_size = k_pages.shape[3]
    pages_per_seq = block_tables.shape[1]
    pages_per_block = max(1, min(kv_block_tokens // page_size, pages_per_seq))
    rows = block_tokens * group
    hb = kv_heads_per_block
    grid = (kv_heads // hb, num_rows // rows)
    row_block = pl.BlockSpec((hb, rows, head_dim), lambda h, i, *_: (h, i, 0))
    block_keys = pages_per_block * page_size
    pools = [k_pages, v_pages] + ([k_scale, v_scale] if k_scale is not None else [])
    buffers = [pltpu.VMEM((2, hb, block_keys) + pool.shape[4:], pool.dtype) for pool in pools]
    body = functools.partial(_attention_kernel, group=group, block_tokens=block_tokens,
                             pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
                             sm_scale=sm_scale, num_pools=len(pools), sliding_window=sliding_window,
                             softcap=softcap)
    return pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=grid,
            in_specs=[row_block] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools),
            out_specs=row_block,
            scratch_shapes=[*buffers, pltpu.SemaphoreType.DMA((len(pools), 2)),
                            pltpu.VMEM((hb, rows, 1), jnp.float32),
                            pltpu.VMEM((hb, rows, 1), jnp.float32),
                            pltpu.VMEM((hb, rows, head_dim), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(layer, block_tables.reshape(-1), kv_lens, cu_q_lens, num_seqs, q_rows, *pools)


def _write_kernel(layer_ref, slots_ref, *refs, num_pools):
    # refs: the new rows (k, v[, k_scale, v_scale]), the pools in (aliased to the pools out, so
    # unused), the pools out, sems.
    new_rows, pools, sems = refs[:num_pools], refs[2 * num_pools:3 * num_pools], refs[-1]
    page_size = pools[0].shape[3]
    shift = page_size.bit_length() - 1  # page_size is a power of two
    layer = layer_ref[0]
    num_tokens = new_rows[0].shape[0]

    def copies(t):
        slot = slots_ref[t]
        page, offset = slot >> shift, slot & (page_size - 1)
        return [pltpu.make_async_copy(new.at[t], pool.at[layer, :, page, pl.ds(offset, 1)], sems.at[i])
                for i, (new, pool) in enumerate(zip(new_rows, pools))]

    def start(t, _):
        for copy in copies(t):
            copy.start()

    def wait(t, _):
        for copy in copies(t):
            copy.wait()

    jax.lax.fori_loop(0, num_tokens, start, None)
    jax.lax.fori_loop(0, num_tokens, wait, None)


def write_kv(pools, new_rows, layer, slot_mapping, *, interpret):
    """new_rows (k, v [T, kv_heads, D] in the pools' dtype[, k_scale, v_scale [T, kv_heads]]) into
    pools (k_pages, v_pages[, k_scale, v_scale]) at [layer, :, page, offset]; returns the
    (aliased) pools."""
    n = len(pools)
    # A token's row as [kv_heads, 1(, D)]: the shape of its window in the pool.
    rows = [x.reshape(x.shape[0], x.shape[1], 1, *x.shape[2:]) for x in new_rows]
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, num_pools=n),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(1,), in_specs=[anywhere] * (2 * n), out_specs=[anywhere] * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA((n,))]),
        out_shape=tuple(jax.ShapeDtypeStruct(pool.shape, pool.dtype) for pool in pools),
        input_output_aliases={2 + n + i: i for i in range(n)},  # operands: layer, slots, rows, pools
        interpret=interpret,
        name="write_kv_tpu",
    )(layer, slot_mapping, *rows, *pools)
