"""The paged attention backends (XLA, and the Pallas kernels interpreted) against dense causal
attention, over random ragged batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoint.loader import load_model
from jaxserve.config import EngineConfig
from jaxserve.engine.batch import BatchLayout, Bucket
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.models.layers.attention import KVPages, PallasPagedAttention, XlaPagedAttention
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
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_matches_dense_attention(backend, heads, kv_heads, page_size, seed):
    check_against_dense_attention(backend, heads, kv_heads, page_size, seed)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_stale_nan_in_reused_pages_reaches_no_one(backend):
    # A request whose model wrote NaN K/V is failed and its pages reused: the slots past a new
    # request's length still hold NaN, and a masked weight of 0 times NaN must not reach it.
    check_against_dense_attention(backend, 9, 3, 4, 0, stale=np.nan)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_decode_slots_with_speculative_drafts_match_dense_attention(backend, seed):
    check_against_dense_attention(backend, 8, 2, 4, seed, max_drafts=4)


@pytest.mark.parametrize("seed", range(8))
def test_the_xla_groups_gathered_from_the_ragged_rows_are_each_slots_and_segments_sequence(seed):
    """XlaPagedAttention.prepare: every decode slot and prompt segment gets the block table and the
    context length of the sequence whose tokens it holds, and a padded one gets none."""
    rng = np.random.default_rng(seed)
    page_size, segment, max_drafts = 4, 8, 3 * (seed % 2)
    layout = BatchLayout(page_size, segment, pages_per_chunk=2, table_width=16, vocab_size=8, history_width=8)
    sequences = []
    for i in range(int(rng.integers(1, 10))):
        num_tokens = int(rng.choice([1, 1, 2, 4, 9, 20]))
        drafts = (0,) * (num_tokens - 1) if 1 < num_tokens <= 1 + max_drafts else ()
        start = int(rng.integers(0, 30))
        table = tuple(int(p) for p in rng.integers(1, 100, -(-(start + num_tokens) // page_size)))
        sequences.append(ScheduledSequence(f"s{i}", (0,) * num_tokens, start, table, True, SamplingParams(), 0, 0,
                                           draft_token_ids=drafts))
    output = SchedulerOutput(tuple(sequences))
    need = layout.needs(output)
    bucket = Bucket(need.num_decode + 1, need.num_segments + 2, need.decode_len)   # padded slots and segments
    batch, _ = layout.build(output, bucket)
    decode, segments = jax.jit(XlaPagedAttention(2).prepare)(batch.attention).groups
    expected = {"decode": [], "segments": []}
    for s in sequences:
        entry = (s.block_table, s.start_position + s.num_tokens)
        if s.num_tokens == 1 or s.draft_token_ids:
            expected["decode"].append(entry)
        else:
            expected["segments"] += [entry] * -(-s.num_tokens // segment)
    for name, group, rows in (("decode", decode, bucket.num_decode), ("segments", segments, bucket.num_segments)):
        entries = expected[name] + [((), 0)] * (rows - len(expected[name]))
        tables = np.zeros((rows, 16), np.int32)
        for row, (table, _) in enumerate(entries):
            tables[row, :len(table)] = table
        np.testing.assert_array_equal(group.block_tables, tables, err_msg=name)
        np.testing.assert_array_equal(group.kv_lens, [kv_len for _, kv_len in entries], err_msg=name)


def check_against_dense_attention(backend, heads, kv_heads, page_size, seed, stale=None, max_drafts=0):
    """Random ragged sequences over a pool whose slots they do not fill hold random values, or
    `stale`; the result must be dense attention's. With `max_drafts`, short chunks are decodes
    with speculative drafts, in decode slots of 1 + max_drafts tokens."""
    rng = np.random.default_rng(seed)
    dim, num_pages, segment = 16, 256, 8
    layout = BatchLayout(page_size, segment, pages_per_chunk=max(1, 16 // page_size), table_width=64,
                         vocab_size=8, history_width=8)
    free_pages = list(rng.permutation(np.arange(1, num_pages)))
    k_pool = rng.normal(size=(2, kv_heads, num_pages, page_size, dim)).astype(np.float32)
    v_pool = rng.normal(size=k_pool.shape).astype(np.float32)
    if stale is not None:
        k_pool[:, :, 1:], v_pool[:, :, 1:] = stale, stale   # page 0, padding's, is never a request's
    layer = 1
    sequences, new_q, new_k, new_v, expected = [], [], [], [], []
    # with drafts: a prompt chunk and a decode with drafts first, so the two groups always meet
    forced = [21, 4] if max_drafts else []
    for i in range(int(rng.integers(1, 7)) + len(forced)):
        q_len = forced[i] if i < len(forced) else int(rng.choice([1, 1, 3, 8, 21] + [2, 3, 5] * (max_drafts > 0)))
        drafts = (0,) * (q_len - 1) if q_len <= 1 + max_drafts else ()
        kv_len = q_len + int(rng.integers(0, 40))
        table = [int(free_pages.pop()) for _ in range(-(-kv_len // page_size))]
        k = rng.normal(size=(kv_len, kv_heads, dim)).astype(np.float32)
        v = rng.normal(size=(kv_len, kv_heads, dim)).astype(np.float32)
        q = rng.normal(size=(q_len, heads, dim)).astype(np.float32)
        for pos in range(kv_len - q_len):              # the context is already in the pool
            k_pool[layer, :, table[pos // page_size], pos % page_size] = k[pos]
            v_pool[layer, :, table[pos // page_size], pos % page_size] = v[pos]
        sequences.append(ScheduledSequence(f"s{i}", (0,) * q_len, kv_len - q_len, tuple(table), True,
                                           SamplingParams(), 0, 0, draft_token_ids=drafts))
        new_q.append(q), new_k.append(k[kv_len - q_len:]), new_v.append(v[kv_len - q_len:])
        expected.append(dense_reference(q, k, v))
    output = SchedulerOutput(tuple(sequences))
    need = layout.needs(output)
    bucket = Bucket(need.num_decode + 2, need.num_segments + 1, need.decode_len)   # padded rows change nothing
    batch, _ = layout.build(output, bucket)
    positions = batch.attention.positions
    packed = np.flatnonzero(positions >= 0)
    order = _packed_order(batch, output, layout, bucket)

    def place(arrays, width):
        out = np.zeros((len(positions), width, dim), np.float32)
        out[order] = np.concatenate(arrays)
        return out

    attention = XlaPagedAttention(layout.pages_per_chunk) if backend == "xla" else PallasPagedAttention()
    out, pages = jax.jit(attention)(place(new_q, heads), place(new_k, kv_heads), place(new_v, kv_heads),
                                    KVPages(jnp.asarray(k_pool), jnp.asarray(v_pool)), jnp.int32(layer),
                                    batch.attention)
    np.testing.assert_allclose(np.asarray(out)[order], np.concatenate(expected), atol=2e-5, rtol=1e-5)
    assert set(packed) == set(order)
    assert np.abs(np.asarray(out)[np.setdiff1d(np.arange(len(positions)), order)]).max(initial=0) == 0


def _packed_order(batch, output, layout, bucket):
    """Packed index of every real token, in sequence order (decodes first in the packed layout)."""
    order, decode, next_token = [], 0, bucket.num_decode * bucket.decode_len
    for s in output.sequences:
        if s.num_tokens == 1 or s.draft_token_ids:
            order.extend(range(decode * bucket.decode_len, decode * bucket.decode_len + s.num_tokens))
            decode += 1
        else:
            order.extend(range(next_token, next_token + s.num_tokens))
            next_token += -(-s.num_tokens // layout.segment) * layout.segment
    return np.array(order)


def _greedy_logits(runner, prompts: dict[str, list[int]], steps: int) -> dict[str, np.ndarray]:
    """Every sequence prefilled in one step, then decoded greedily: [steps + 1, vocab] each."""
    pages = iter(np.random.default_rng(0).permutation(np.arange(1, 64)).tolist())
    tables = {name: tuple(next(pages) for _ in range(-(-(len(p) + steps) // runner.layout.page_size)))
              for name, p in prompts.items()}
    tokens = {name: list(p) for name, p in prompts.items()}
    rows = {name: [] for name in prompts}
    for step in range(steps + 1):
        seqs = tuple(ScheduledSequence(name, tuple(t[-1:] if step else t), len(t) - 1 if step else 0,
                                       tables[name], True, SamplingParams(temperature=0), 0, 0)
                     for name, t in tokens.items())
        for name, logits in runner.logits(SchedulerOutput(seqs)).items():
            rows[name].append(logits)
            tokens[name].append(int(np.argmax(logits)))
    return {name: np.stack(r) for name, r in rows.items()}


# the window (12) < the long prompt; Gemma 2 alternates windowed and full layers and soft-caps,
# Gemma 3 has two windowed layers and a full one
@pytest.mark.parametrize("variant", ["llama", "mistral_window", "gemma2", "gemma3"])
def test_pallas_backend_gives_the_xla_logits_on_a_tiny_model(variant, tiny_models):
    directory, _ = tiny_models(variant)
    model = load_model(str(directory), "float32")
    rng = np.random.default_rng(1)
    prompts = {name: rng.integers(0, model.config.vocab_size, n).tolist()
               for name, n in (("long", 37), ("short", 6), ("one", 1))}
    logits = {backend: _greedy_logits(Runner(model, 64, 4, 128, 4, 64, 16, kv_chunk_tokens=8,
                                             attention_backend=backend), prompts, steps=8)
              for backend in ("xla", "pallas")}
    for name in prompts:
        np.testing.assert_allclose(logits["pallas"][name], logits["xla"][name], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_pallas_backend_gives_the_xla_tokens_on_smollm2(smollm2):
    prompts = ["Tell me about the history of Rome, from its founding to the fall of the Western empire.",
               "def quicksort(items):\n    " * 6, "Hi!"]
    tokens = {}
    for backend in ("xla", "pallas"):
        engine = LLMEngine(EngineConfig(attention_backend=backend, num_pages=64, max_num_seqs=4,
                                        max_num_batched_tokens=64, prefill_segment=32, max_model_len=256),
                           model=smollm2)
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens[backend] = [done[i] for i in ids]
    assert [len(engine.tokenizer.encode(p)) // 16 for p in prompts] != [0] * 3   # prompts cross pages
    assert tokens["pallas"] == tokens["xla"]
