"""The XLA paged attention against dense causal attention, over random ragged batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.batch import BatchLayout, Bucket
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.models.layers.attention import KVPages, XlaPagedAttention
from jaxserve.sampling_params import SamplingParams


def dense_reference(q, k, v):
    """q [n, H, D] at the last n of k/v's [L, KV, D] positions, causal."""
    n, heads, dim = q.shape
    length, kv_heads, _ = k.shape
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    q_pos = np.arange(length - n, length)[:, None]
    scores = np.where(np.arange(length)[None, :] <= q_pos, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (9, 3)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_dense_attention(heads, kv_heads, page_size, seed):
    rng = np.random.default_rng(seed)
    dim, num_pages, segment = 16, 256, 8
    layout = BatchLayout(page_size, segment, pages_per_chunk=max(1, 16 // page_size), table_width=64,
                         vocab_size=8, history_width=8)
    free_pages = list(rng.permutation(np.arange(1, num_pages)))
    k_pool = rng.normal(size=(2, kv_heads, num_pages, page_size, dim)).astype(np.float32)
    v_pool = rng.normal(size=k_pool.shape).astype(np.float32)
    layer = 1
    sequences, new_q, new_k, new_v, expected = [], [], [], [], []
    for i in range(int(rng.integers(1, 7))):
        q_len = int(rng.choice([1, 1, 3, 8, 21]))
        kv_len = q_len + int(rng.integers(0, 40))
        table = [int(free_pages.pop()) for _ in range(-(-kv_len // page_size))]
        k = rng.normal(size=(kv_len, kv_heads, dim)).astype(np.float32)
        v = rng.normal(size=(kv_len, kv_heads, dim)).astype(np.float32)
        q = rng.normal(size=(q_len, heads, dim)).astype(np.float32)
        for pos in range(kv_len - q_len):              # the context is already in the pool
            k_pool[layer, :, table[pos // page_size], pos % page_size] = k[pos]
            v_pool[layer, :, table[pos // page_size], pos % page_size] = v[pos]
        sequences.append(ScheduledSequence(f"s{i}", (0,) * q_len, kv_len - q_len, tuple(table), True,
                                           SamplingParams(), 0, 0))
        new_q.append(q), new_k.append(k[kv_len - q_len:]), new_v.append(v[kv_len - q_len:])
        expected.append(dense_reference(q, k, v))
    output = SchedulerOutput(tuple(sequences))
    need = layout.needs(output)
    bucket = Bucket(need.num_decode + 2, need.num_segments + 1)   # padded rows must change nothing
    batch, _ = layout.build(output, bucket)
    positions = batch.attention.positions
    packed = np.flatnonzero(positions >= 0)
    order = _packed_order(batch, output, layout, bucket)

    def place(arrays, width):
        out = np.zeros((len(positions), width, dim), np.float32)
        out[order] = np.concatenate(arrays)
        return out

    attention = XlaPagedAttention(layout.pages_per_chunk)
    out, pages = jax.jit(attention)(place(new_q, heads), place(new_k, kv_heads), place(new_v, kv_heads),
                                    KVPages(jnp.asarray(k_pool), jnp.asarray(v_pool)), jnp.int32(layer),
                                    batch.attention)
    np.testing.assert_allclose(np.asarray(out)[order], np.concatenate(expected), atol=2e-5, rtol=1e-5)
    assert set(packed) == set(order)
    assert np.abs(np.asarray(out)[np.setdiff1d(np.arange(len(positions)), order)]).max(initial=0) == 0


def _packed_order(batch, output, layout, bucket):
    """Packed index of every real token, in sequence order (decodes first in the packed layout)."""
    order, decode, next_token = [], 0, bucket.num_decode
    for s in output.sequences:
        if s.num_tokens == 1:
            order.append(decode)
            decode += 1
        else:
            order.extend(range(next_token, next_token + s.num_tokens))
            next_token += -(-s.num_tokens // layout.segment) * layout.segment
    return np.array(order)
