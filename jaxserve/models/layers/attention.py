"""Paged attention over a ragged batch, and the backend interface the model calls.

The KV pool is one K and one V array per model, each `[num_layers, num_pages, page_size,
num_kv_heads, head_dim]`; page 0 is reserved for padding, so padded tokens write there and nothing
real ever reads it. A step's new tokens are packed along one axis `T`. Each layer first writes the
step's K/V into their pages (`slot_mapping`), then every query attends to its own sequence's pages,
which now hold the whole context, causally by position.

For attention (not for the matmuls) the XLA backend views the packed tokens in two groups, so that
a mixed step costs about what its real tokens cost:
  decode group  [Gd, 1]   one query per sequence (decodes, and 1-token prefill tails)
  prefill group [Gp, Qc]  prefill chunks cut into segments of `Qc` queries of one sequence
Both loop over the context in chunks of pages with an online (flash) softmax, so no program is
compiled per context length and no `[queries, context]` score matrix is ever built.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

MASKED = -1e30  # a finite "minus infinity": exp() of it is 0, and 0 * it is not NaN


@struct.dataclass
class KVPages:
    """The device KV pool; donated to every step and returned updated."""

    k: jax.Array  # [layers, pages, page_size, kv_heads, head_dim]
    v: jax.Array  # [layers, pages, page_size, kv_heads, head_dim]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


@struct.dataclass
class QueryGroup:
    """Queries of one attention group gathered out of the packed batch."""

    token_index: jax.Array   # [G, Q] int32: packed index of each query; T (out of range) pads
    block_tables: jax.Array  # [G, pages_per_seq] int32: the sequence's pages in order; 0 pads
    num_chunks: jax.Array    # [] int32: context chunks to visit, the group's longest context


@struct.dataclass
class AttentionMetadata:
    """Where every packed token sits: its position, its KV slot and its attention group."""

    positions: jax.Array     # [T] int32: position in its sequence; -1 for padding
    slot_mapping: jax.Array  # [T] int32: page * page_size + offset to write K/V; 0..page_size-1 pads
    decode: QueryGroup       # Q = 1
    prefill: QueryGroup      # Q = prefill segment length


class AttentionBackend(Protocol):
    """Writes the step's K/V into the pool and attends; the model calls nothing else."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: KVPages,
                 layer: jax.Array, meta: AttentionMetadata) -> tuple[jax.Array, KVPages]:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim], layer [] int32 ->
        (out [T, heads, head_dim], updated kv_pages)."""
        ...


def write_kv(kv_pages: KVPages, k: jax.Array, v: jax.Array, layer: jax.Array,
             slot_mapping: jax.Array) -> KVPages:
    """Scatters the new K/V [T, kv_heads, head_dim] into `layer`'s pages, in place under donation."""
    pages, offsets = slot_mapping // kv_pages.page_size, slot_mapping % kv_pages.page_size
    return KVPages(
        k=kv_pages.k.at[layer, pages, offsets].set(k.astype(kv_pages.k.dtype)),
        v=kv_pages.v.at[layer, pages, offsets].set(v.astype(kv_pages.v.dtype)),
    )


def attend_group(q: jax.Array, positions: jax.Array, group: QueryGroup, kv_pages: KVPages,
                 layer: jax.Array, pages_per_chunk: int) -> jax.Array:
    """Causal attention of one group's queries to their sequences' pages.

    q [T, heads, head_dim] packed; returns [G, Q, heads, head_dim] in q's dtype (zeros for padding).
    """
    num_seqs, q_len = group.token_index.shape
    _, heads, head_dim = q.shape
    kv_heads = kv_pages.k.shape[3]
    rep = heads // kv_heads
    chunk_len = pages_per_chunk * kv_pages.page_size

    qg = jnp.take(q, group.token_index, axis=0, mode="fill", fill_value=0)
    qg = qg.reshape(num_seqs, q_len, kv_heads, rep, head_dim).astype(jnp.float32)
    qg = qg * (head_dim ** -0.5)
    q_pos = jnp.take(positions, group.token_index, mode="fill", fill_value=-1)  # [G, Q]

    def visit_chunk(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(group.block_tables, i * pages_per_chunk,
                                             pages_per_chunk, axis=1)
        k = kv_pages.k[layer, pages].reshape(num_seqs, chunk_len, kv_heads, head_dim)
        v = kv_pages.v[layer, pages].reshape(num_seqs, chunk_len, kv_heads, head_dim)
        s = jnp.einsum("gqhrd,gchd->ghrqc", qg, k.astype(jnp.float32))
        k_pos = i * chunk_len + jnp.arange(chunk_len)
        visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [G, Q, C]
        s = jnp.where(visible[:, None, None], s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None]) * visible[:, None, None]
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("ghrqc,gchd->ghrqd", p, v.astype(jnp.float32))
        return m_new, l, acc

    stats_shape = (num_seqs, kv_heads, rep, q_len)
    init = (jnp.full(stats_shape, MASKED, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, group.num_chunks, visit_chunk, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # all-masked (padding) rows stay 0
    return out.transpose(0, 3, 1, 2, 4).reshape(num_seqs, q_len, heads, head_dim).astype(q.dtype)


class XlaPagedAttention:
    """The plain-jnp backend: the default on CPU, and the reference for the Pallas kernels."""

    def __init__(self, pages_per_chunk: int):
        self.pages_per_chunk = pages_per_chunk

    def __call__(self, q, k, v, kv_pages, layer, meta):
        kv_pages = write_kv(kv_pages, k, v, layer, meta.slot_mapping)
        out = jnp.zeros_like(q)
        for group in (meta.decode, meta.prefill):
            if group.token_index.size == 0:
                continue
            group_out = attend_group(q, meta.positions, group, kv_pages, layer, self.pages_per_chunk)
            flat_index = group.token_index.reshape(-1)
            out = out.at[flat_index].set(group_out.reshape(-1, *q.shape[1:]), mode="drop")
        return out, kv_pages
