"""Paged attention over a ragged batch, and the backend interface the model calls.

The KV pool is one K and one V array per model, each `[num_layers, num_kv_heads, num_pages,
page_size, head_dim]`: head-major, so one head's page is a contiguous `[page_size, head_dim]`
block that attention multiplies without a transpose. Page 0 is reserved for padding: padded
tokens write there, and nothing real ever reads it. Each layer first writes the step's K/V into
their pages (`slot_mapping`), then every query attends to its own sequence's pages, which now
hold the whole context, causally by position.

The step's tokens are packed along one axis `T = Gd * L + Gp * S`, so that a step that mixes
decodes and prompt chunks costs about what its real tokens cost:
  decode slots  [Gd, L]   the first Gd * L tokens: one slot per sequence (decodes, 1-token prompt
                          tails), L = 1, or 1 + K with K speculative drafts per decode
  segments      [Gp, S]   the rest: prompt chunks cut into segments of S tokens of one sequence
                          (S = `--prefill-segment`)
Padding tokens sit at position -1 and see nothing. Every backend reads one description of them,
the Pallas kernels' contract (`RaggedRows`): contiguous rows of tokens, each a sequence's chunk or
a run of padding, with its context length and block table. The XLA backend reads the decode slots
and the segments as two groups of equal rows, whose block tables it gathers from the ragged rows
once a step (`XlaPagedAttention.prepare`); each group loops over the context in chunks of pages
with an online (flash) softmax, so no program is compiled per context length and no
`[queries, context]` score matrix is ever built.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels.ragged_paged_attention as rpa
from jaxserve.config import ModelConfig
from jaxserve.models.layers import float8

MASKED = -1e30  # a finite "minus infinity": exp() of it is 0, and 0 * it is not NaN


@struct.dataclass
class KVPages:
    """The device KV pool; donated to every step and returned updated.

    Pages hold the compute dtype, or a narrow one (`--kv-cache-dtype`): float8_e4m3fn with one
    scale of 1 for the whole pool (vLLM's default; values clipped to +-448; the XLA backend on a
    CPU keeps them as their bytes, uint8: float8.py), or int8 with a scale for every token and KV
    head (written once with its token, so no page is ever requantised).
    """

    k: jax.Array  # [layers, kv_heads, pages, page_size, head_dim]
    v: jax.Array  # [layers, kv_heads, pages, page_size, head_dim]
    k_scale: jax.Array | None = None  # [layers, kv_heads, pages, page_size] float32: int8 pools only
    v_scale: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


@struct.dataclass
class QueryGroup:
    """The XLA backend's rows of one group (decode slots or segments), equal in length: whose
    pages each row of queries reads. Gathered on the device from the step's `RaggedRows`."""

    block_tables: jax.Array  # [G, pages_per_seq] int32: the row's sequence's pages in order; 0 pads
    kv_lens: jax.Array       # [G] int32: the row's context length (0: padding)


@struct.dataclass
class RaggedRows:
    """The step's tokens as contiguous rows, as ragged kernels take them: row r's queries are the
    packed tokens [cu_q_lens[r], cu_q_lens[r + 1]), a sequence's chunk or a run of padding (kv_len
    0: it sees nothing); tokens past cu_q_lens[num_rows[0]] are padding too. The one layout every
    backend reads (`pallas_kernels.ragged_paged_attention`'s contract)."""

    block_tables: jax.Array  # [R, pages_per_seq] int32
    kv_lens: jax.Array       # [R] int32: context length, the row's tokens included
    cu_q_lens: jax.Array     # [R + 1] int32
    num_rows: jax.Array      # [1] int32


@struct.dataclass
class AttentionMetadata:
    """Where every packed token sits: its position, its KV slot and its row."""

    positions: jax.Array     # [T] int32: position in its sequence; -1 for padding
    slot_mapping: jax.Array  # [T] int32: page * page_size + offset to write K/V; 0..page_size-1 pads
    ragged: RaggedRows
    num_decode: int = struct.field(pytree_node=False)     # Gd: decode slots
    num_segments: int = struct.field(pytree_node=False)   # Gp: prompt segments
    decode_len: int = struct.field(pytree_node=False, default=1)     # L: 1, or 1 + speculative drafts
    groups: tuple[QueryGroup, QueryGroup] | None = None   # the XLA backend's decode slots and segments,
                                                          # gathered from `ragged` on the device (prepare)


class AttentionBackend(Protocol):
    """Writes the step's K/V into the pool and attends; the model calls nothing else, and `prepare`
    once a step, before the layers."""

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """`meta` with what the backend derives from it once for every layer."""
        ...

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_pages: KVPages,
                 layer: jax.Array, meta: AttentionMetadata) -> tuple[jax.Array, KVPages]:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim], layer [] int32 ->
        (out [T, heads, head_dim], updated kv_pages)."""
        ...


def write_kv(kv_pages: KVPages, k: jax.Array, v: jax.Array, layer: jax.Array,
             slot_mapping: jax.Array) -> KVPages:
    """Scatters the new K/V [T, kv_heads, head_dim] into `layer`'s pages, in place under donation."""
    pages, offsets = slot_mapping // kv_pages.page_size, slot_mapping % kv_pages.page_size
    # One quantizer for both backends: the kernels package's (the pages' format is its contract).
    as_bytes = kv_pages.k.dtype == float8.BYTES
    dtype = float8.FLOAT8 if as_bytes else kv_pages.k.dtype
    (k, k_scale), (v, v_scale) = rpa.quantize_kv(k, dtype), rpa.quantize_kv(v, dtype)
    if as_bytes:
        k, v = float8.to_bytes(k), float8.to_bytes(v)
    # Index arrays split by a slice put their dimension first: the update is [T, kv_heads, head_dim].
    at = (layer, slice(None), pages, offsets)
    scales = {}
    if kv_pages.k_scale is not None:
        scales = dict(k_scale=kv_pages.k_scale.at[at].set(k_scale), v_scale=kv_pages.v_scale.at[at].set(v_scale))
    return KVPages(k=kv_pages.k.at[at].set(k), v=kv_pages.v.at[at].set(v), **scales)


def attend_group(q: jax.Array, q_pos: jax.Array, group: QueryGroup, kv_pages: KVPages,
                 layer: jax.Array, pages_per_chunk: int, sliding_window: int | jax.Array | None = None,
                 softcap: float | None = None) -> jax.Array:
    """Causal attention of one group's queries to their sequences' pages.

    q [G, Q, heads, head_dim], q_pos [G, Q] (-1: padding) -> [G, Q, heads, head_dim] in q's dtype,
    zeros for padding. With `sliding_window` W a query at p sees keys p - W + 1 .. p, and chunks
    before every row's window are never visited; W may be traced (a layer's own), 0 for none.
    `softcap` c: scores become c * tanh(scores / c) (Gemma 2).
    """
    num_seqs, q_len, heads, head_dim = q.shape
    kv_heads = kv_pages.k.shape[1]
    rep = heads // kv_heads
    chunk_len = pages_per_chunk * kv_pages.page_size
    num_chunks = (group.kv_lens.max() + chunk_len - 1) // chunk_len   # for the group's longest context

    # Rows of one KV head and one sequence side by side: [kv_heads, G, rep * Q, D].
    qg = q.reshape(num_seqs, q_len, kv_heads, rep, head_dim).transpose(2, 0, 3, 1, 4)
    qg = qg.reshape(kv_heads, num_seqs, rep * q_len, head_dim).astype(jnp.float32) * (head_dim ** -0.5)
    q_pos = jnp.tile(q_pos, (1, rep))[None, :, :, None]  # [1, G, rep * Q, 1]
    last_pos = q_pos.max(axis=2)                          # [1, G, 1]: the furthest any query sees

    def visit_chunk(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(group.block_tables, i * pages_per_chunk,
                                             pages_per_chunk, axis=1)
        k = _gather_pages(kv_pages.k, layer, pages, kv_pages.k_scale)  # [kv_heads, G, C, D]
        v = _gather_pages(kv_pages.v, layer, pages, kv_pages.v_scale)
        s = jnp.einsum("hgqd,hgcd->hgqc", qg, k)
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        key = i * chunk_len + jnp.arange(chunk_len)
        visible = key <= q_pos  # [1, G, rep*Q, C]
        if sliding_window is not None:
            visible &= (sliding_window == 0) | (key > q_pos - sliding_window)
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        p = jnp.exp(s - m_new) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1, keepdims=True)
        # Slots past a sequence's end may hold a failed request's NaN: 0 weight * NaN is NaN.
        v = jnp.where((key <= last_pos)[..., None], v, 0)
        acc = acc * correction + jnp.einsum("hgqc,hgcd->hgqd", p, v)
        return m_new, l, acc

    stats_shape = (kv_heads, num_seqs, rep * q_len, 1)
    init = (jnp.full(stats_shape, MASKED, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape[:-1] + (head_dim,), jnp.float32))
    first = 0
    if sliding_window is not None:   # the chunk holding the earliest key any row's window reaches
        earliest = jnp.where(q_pos >= 0, q_pos - sliding_window + 1, jnp.iinfo(jnp.int32).max).min()
        first = jnp.where(sliding_window == 0, 0, jnp.clip(earliest // chunk_len, 0, num_chunks))
    _, l, acc = jax.lax.fori_loop(first, num_chunks, visit_chunk, init)
    out = acc / jnp.maximum(l, 1e-30)  # all-masked (padding) rows stay 0
    out = out.reshape(kv_heads, num_seqs, rep, q_len, head_dim).transpose(1, 3, 0, 2, 4)
    return out.reshape(num_seqs, q_len, heads, head_dim).astype(q.dtype)


def _gather_pages(pool: jax.Array, layer: jax.Array, pages: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """pool [layers, kv_heads, P, page_size, D], pages [G, n] -> [kv_heads, G, n * page_size, D] f32
    (scaled by `scale` [layers, kv_heads, P, page_size] for int8 pools; a uint8 pool holds
    float8_e4m3fn's bytes, see float8.py)."""
    kv_heads, _, page_size, head_dim = pool.shape[1:]
    # One gather from the whole pool (slicing the layer out first would copy it).
    heads = jnp.arange(kv_heads)[:, None, None]
    blocks = float8.values(pool[layer, heads, pages[None]], jnp.float32)
    if scale is not None:
        blocks = blocks * scale[layer, heads, pages[None]][..., None]
    return blocks.reshape(kv_heads, pages.shape[0], pages.shape[1] * page_size, head_dim)


class XlaPagedAttention:
    """The plain-jnp backend: the default on CPU, and the reference for the Pallas kernels.
    `layer_windows`: each layer's window (0: none) where layers differ (Gemma); `softcap`: see
    `attend_group`."""

    def __init__(self, pages_per_chunk: int, sliding_window: int | None = None,
                 layer_windows: tuple[int, ...] = (), softcap: float | None = None):
        self.pages_per_chunk = pages_per_chunk
        self.sliding_window = sliding_window
        self.layer_windows = layer_windows
        self.softcap = softcap

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The decode slots' and the segments' block tables and context lengths, gathered from the
        ragged rows: each slot's and segment's first token lies in the row of its sequence's chunk
        (or of padding), which every later token of it shares."""
        rows, decode_end = meta.ragged, meta.num_decode * meta.decode_len
        segment = (meta.positions.shape[0] - decode_end) // max(meta.num_segments, 1)
        firsts = jnp.concatenate([jnp.arange(meta.num_decode, dtype=jnp.int32) * meta.decode_len,
                                  decode_end + jnp.arange(meta.num_segments, dtype=jnp.int32) * segment])
        row = jnp.clip(jnp.searchsorted(rows.cu_q_lens, firsts, side="right") - 1, 0, rows.kv_lens.shape[0] - 1)
        real = firsts < rows.cu_q_lens[rows.num_rows[0]]   # past the last row: padding
        tables = jnp.where(real[:, None], rows.block_tables[row], 0)
        kv_lens = jnp.where(real, rows.kv_lens[row], 0)
        split = meta.num_decode
        return meta.replace(groups=(QueryGroup(tables[:split], kv_lens[:split]),
                                    QueryGroup(tables[split:], kv_lens[split:])))

    def __call__(self, q, k, v, kv_pages, layer, meta):
        kv_pages = write_kv(kv_pages, k, v, layer, meta.slot_mapping)
        num_decode, num_segments = meta.num_decode, meta.num_segments
        decode_end = num_decode * meta.decode_len
        window = jnp.asarray(self.layer_windows)[layer] if self.layer_windows else self.sliding_window
        groups = meta.groups if meta.groups is not None else self.prepare(meta).groups   # called alone (tests)
        outs = []
        for group, num_rows, start, stop in ((groups[0], num_decode, 0, decode_end),
                                             (groups[1], num_segments, decode_end, q.shape[0])):
            if num_rows:
                group_q = q[start:stop].reshape(num_rows, -1, *q.shape[1:])
                group_pos = meta.positions[start:stop].reshape(num_rows, -1)
                out = attend_group(group_q, group_pos, group, kv_pages, layer, self.pages_per_chunk, window,
                                   self.softcap)
                outs.append(out.reshape(-1, *q.shape[1:]))
        return jnp.concatenate(outs), kv_pages


class PallasPagedAttention:
    """The Pallas kernels (`pallas_kernels.ragged_paged_attention`): the step's K/V written into the
    pool in place, then one ragged attention call over all the step's tokens. Interpreted on CPU
    (slow: for tests), compiled on TPU (Mosaic) and GPU (Triton). Reads every pool dtype: the
    compute dtype, int8 with its scales, float8_e4m3fn. `layer_windows` (Gemma): the kernel's
    window is static, so each layer calls the windowed or the full one under a `lax.cond`;
    `softcap`: Gemma 2's attention logit soft-capping."""

    def __init__(self, sliding_window: int | None = None, layer_windows: tuple[int, ...] = (),
                 softcap: float | None = None):
        self.sliding_window = sliding_window
        self.layer_windows = layer_windows
        self.softcap = softcap

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def __call__(self, q, k, v, kv_pages, layer, meta):
        rows = meta.ragged
        scales = () if kv_pages.k_scale is None else (kv_pages.k_scale, kv_pages.v_scale)
        kv_pages = KVPages(*rpa.write_kv(kv_pages.k, kv_pages.v, k, v, layer, meta.slot_mapping, *scales))

        def attend(window):
            return rpa.ragged_paged_attention(q, kv_pages.k, kv_pages.v, layer, rows.block_tables, rows.kv_lens,
                                              rows.cu_q_lens, rows.num_rows, kv_pages.k_scale, kv_pages.v_scale,
                                              sliding_window=window, softcap=self.softcap)

        if not self.layer_windows:
            return attend(self.sliding_window), kv_pages
        # Gemma: the kernel's window is static, so each layer takes the windowed or the full one
        windowed = jnp.asarray(self.layer_windows)[layer] > 0
        out = jax.lax.cond(windowed, lambda: attend(self.sliding_window), lambda: attend(None))
        return out, kv_pages


def layer_windows(cfg: ModelConfig) -> tuple[int, ...]:
    """Each layer's window (0: none) where the layers differ (Gemma 2 / 3); () where they do not."""
    if not cfg.sliding_layers or cfg.sliding_window is None:
        return ()
    return tuple(cfg.sliding_window if windowed else 0 for windowed in cfg.sliding_layers)


def backend_for(cfg: ModelConfig, name: str, pages_per_chunk: int) -> AttentionBackend:
    """The attention backend `name` (xla | pallas) set up for the model's windows and soft-capping."""
    if name == "pallas":
        return PallasPagedAttention(cfg.sliding_window, layer_windows(cfg), cfg.attn_logit_softcapping)
    return XlaPagedAttention(pages_per_chunk, cfg.sliding_window, layer_windows(cfg), cfg.attn_logit_softcapping)


class MeshAttention:
    """Runs a backend under `shard_map` over the mesh: each device takes its data slice's tokens
    and attention rows (`data`) and its own query and KV heads (`model`), and writes and reads its
    own block of the pool, whose page ids are local to the slice. Nothing crosses devices."""

    def __init__(self, backend: AttentionBackend, mesh: Mesh, scaled: bool = False):
        heads = P("data", "model", None)
        pages = P(None, "model", "data")
        pool = KVPages(k=pages, v=pages, k_scale=pages if scaled else None, v_scale=pages if scaled else None)
        self._call = jax.shard_map(backend, mesh=mesh, in_specs=(heads, heads, heads, pool, P(), P("data")),
                                   out_specs=(heads, pool), check_vma=False)
        self._prepare = jax.shard_map(backend.prepare, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                      check_vma=False)

    def prepare(self, meta):
        return self._prepare(meta)

    def __call__(self, q, k, v, kv_pages, layer, meta):
        return self._call(q, k, v, kv_pages, layer, meta)
