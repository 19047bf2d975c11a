"""Ragged paged attention: both kernel variants against the jnp reference (pools of the compute
dtype, int8 with scales, fp8, sliding windows), the reference against dense attention in numpy,
write_kv against the jnp scatter, and Mosaic/Triton lowerings by export.

On CPU both variants run interpreted. With JAXSERVE_PALLAS_INTERPRET=0 the variant of the default
backend runs compiled instead (tools/gpu_check.sh); interpret-only tests then skip.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (Tuning, quantize_kv, ragged_paged_attention,
                                                   ragged_paged_attention_reference, tuning_for,
                                                   write_kv, write_kv_reference)
from pallas_kernels.ragged_paged_attention.reference import visible_keys
from pallas_kernels.ragged_paged_attention.tuning import TABLE

COMPILED = os.environ.get("JAXSERVE_PALLAS_INTERPRET", "1") == "0"
INTERPRET = not COMPILED
if COMPILED:
    VARIANTS = [p for p in ("gpu", "tpu") if p == jax.default_backend()] or [
        pytest.param(None, marks=pytest.mark.skip(reason="compiled mode needs a GPU or TPU backend"))]
else:
    VARIANTS = ["tpu", "gpu"]
interpret_only = pytest.mark.skipif(COMPILED, reason="interpret-mode test (CPU)")

# Blocks smaller than every test shape: many query blocks, KV blocks and head blocks per call.
SMALL = Tuning(q_block_tokens=16, decode_q_block_tokens=1, kv_block_tokens=16, kv_heads_per_block=1,
               gpu_block_rows=16, gpu_decode_block_rows=16, write_block_tokens=16)
JUNK = 3e4
KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    tuning: Tuning | None = None  # None: this device's table entry
    tokens: int = 160             # packed tokens per call, padding included
    max_seqs: int = 16            # block-table rows
    max_q: int = 64
    max_kv: int = 600
    context_budget: int = 2400    # KV tokens of all sequences together (sets the pool size)
    layers: int = 2

    def __str__(self):
        small = "-small" if self.tuning == SMALL else ""
        return (f"h{self.heads}kv{self.kv_heads}d{self.head_dim}p{self.page_size}-{self.dtype}{small}"
                f"-t{self.tokens}")

    @property
    def pages_per_seq(self):
        return -(-self.max_kv // self.page_size) + 2

    @property
    def num_pages(self):
        return 1 + self.context_budget // self.page_size + self.max_seqs


def random_lengths(rng, shape: Shape, num_seqs: int):
    """(q_lens, kv_lens): decodes and chunks mixed, a few rows with kv_len < q_len."""
    q_lens = np.where(rng.random(num_seqs) < 0.5, 1, rng.integers(1, shape.max_q + 1, num_seqs))
    while q_lens.sum() > shape.tokens - 4:
        q_lens[q_lens.argmax()] //= 2
    assert q_lens.min() >= 1, f"{shape}: too few tokens for {num_seqs} sequences"
    per_seq = min(shape.max_kv, shape.context_budget // num_seqs)
    q_lens = np.minimum(q_lens, per_seq)
    kv_lens = q_lens + rng.integers(0, per_seq - q_lens + 1)
    gaps = rng.random(num_seqs) < 0.1
    kv_lens[gaps] = rng.integers(0, q_lens[gaps])
    return q_lens, kv_lens


def random_batch(rng, shape: Shape, num_seqs: int, pool: np.ndarray):
    """One call's arguments over `pool` [2, layers, ...]: shuffled pages, junk in page 0, in page
    tails and in unused table rows."""
    dtype = jnp.dtype(shape.dtype)
    k_pages, v_pages = pool.copy()
    q_lens, kv_lens = random_lengths(rng, shape, num_seqs)
    rows, width, size = shape.max_seqs, shape.pages_per_seq, shape.page_size
    tables = np.where(rng.random((rows, width)) < 0.8, 0, rng.integers(0, shape.num_pages, (rows, width)))
    free = iter(rng.permutation(np.arange(1, shape.num_pages)))
    for s in range(num_seqs):
        count = -(-kv_lens[s] // size)
        tables[s, :count] = [next(free) for _ in range(count)]
        if kv_lens[s] % size:  # the unwritten tail of the last page
            for pool_array in (k_pages, v_pages):
                pool_array[:, :, tables[s, count - 1], kv_lens[s] % size:] = JUNK
    for pool_array in (k_pages, v_pages):
        pool_array[:, :, 0] = JUNK
    cu_q_lens = rng.integers(0, shape.tokens, rows + 1)  # junk past num_seqs
    cu_q_lens[:num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    all_kv_lens = rng.integers(0, 10 * shape.max_kv, rows)
    all_kv_lens[:num_seqs] = kv_lens
    q = rng.standard_normal((shape.tokens, shape.heads, shape.head_dim)).astype(np.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            i32(shape.layers - 1), i32(tables), i32(all_kv_lens), i32(cu_q_lens), i32([num_seqs]))


def dense_attention(q, k_pages, v_pages, layer, block_tables, kv_lens, cu_q_lens, num_seqs,
                    sliding_window=None, softcap=None):
    """float64 numpy, one query at a time over its sequence's whole context (or the last
    `sliding_window` keys up to its position), gathered densely; scores soft-capped by `softcap`."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    tokens, heads, head_dim = q.shape
    kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    out = np.zeros_like(q)
    for s in range(int(num_seqs[0])):
        kv_len, start, end = int(kv_lens[s]), int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        slots = np.arange(kv_len)
        pages = np.asarray(block_tables)[s, slots // page_size]
        k = k_pages[int(layer), :, pages, slots % page_size]  # [kv_len, kv_heads, D]
        v = v_pages[int(layer), :, pages, slots % page_size]
        for i, t in enumerate(range(start, end)):
            seen = kv_len - (end - start) + i + 1
            if seen <= 0:
                continue
            lo = max(0, seen - sliding_window) if sliding_window else 0
            for h in range(heads):
                kh = h // (heads // kv_heads)
                scores = k[lo:seen, kh] @ q[t, h] * head_dim ** -0.5
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                out[t, h] = weights @ v[lo:seen, kh] / weights.sum()
    return out


def assert_close(out, expected, dtype):
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol)


def assert_blind_rows_zero(out, args):
    """Padding tokens and queries at negative positions: exactly 0."""
    _, visible = visible_keys(args[6], args[5], args[7], out.shape[0])
    blind = np.asarray(visible) == 0
    assert np.all(np.asarray(out, np.float32)[blind] == 0)


def narrow_pool(args, kv_dtype: str):
    """args with the pool quantized to `kv_dtype` ("int8": its scales appended). The junk rows
    (page 0, page tails) become NaN: fp8 values, int8 scales."""
    q, k_pages, v_pages, *metadata = args
    pools, scales = [], []
    for pool in (k_pages, v_pages):
        junk = (pool == JUNK).all(axis=-1)
        values, scale = quantize_kv(jnp.where(junk[..., None], jnp.nan, pool), KV_DTYPES[kv_dtype])
        pools.append(values)
        if scale is not None:
            scales.append(jnp.where(junk, jnp.nan, scale))
    return (q, *pools, *metadata, *scales)


@functools.lru_cache(maxsize=None)
def batches(shape: Shape, count: int = 4, seed: int = 0, kv_dtype: str | None = None,
            sliding_window: int | None = None, softcap: float | None = None):
    """`count` (args, reference out) pairs with 1, 16 and random sequence counts; cached per shape.
    kv_dtype "int8" | "fp8": over that narrow pool (`narrow_pool`). sliding_window, softcap: the
    reference's (the batches themselves do not depend on them)."""
    rng = np.random.default_rng(seed)
    reference = jax.jit(functools.partial(ragged_paged_attention_reference,
                                          sliding_window=sliding_window, softcap=softcap))
    pool_shape = (shape.layers, shape.kv_heads, shape.num_pages, shape.page_size, shape.head_dim)
    pool = rng.standard_normal((2, *pool_shape)).astype(np.float32)
    result = []
    for num_seqs in [1, shape.max_seqs] + list(rng.integers(2, shape.max_seqs, count - 2)):
        args = random_batch(rng, shape, int(num_seqs), pool)
        if kv_dtype is not None:
            args = narrow_pool(args, kv_dtype)
        result.append((args, reference(*args)))
    return result


def run_kernel(platform, shape: Shape, args, **kw):
    return ragged_paged_attention(*args, platform=platform, tuning=shape.tuning, interpret=INTERPRET,
                                  **kw)


FAST_SHAPES = [
    Shape(8, 8, 64, 8, "float32"),
    Shape(8, 2, 128, 16, "bfloat16", SMALL),
    Shape(9, 3, 64, 16, "float32", SMALL),
    Shape(9, 3, 128, 32, "bfloat16"),
    Shape(8, 2, 128, 16, "bfloat16", SMALL, tokens=24),  # decode-like: tokens <= 2 * rows
]
SLOW_SHAPES = [
    Shape(8, 2, 64, 32, "float32", SMALL),
    Shape(8, 8, 128, 16, "bfloat16"),
    Shape(9, 3, 64, 8, "bfloat16"),
    Shape(8, 2, 128, 8, "float32", SMALL),
    Shape(9, 3, 128, 16, "float32"),
    Shape(8, 8, 64, 32, "bfloat16", SMALL),
    Shape(9, 3, 64, 8, "float32", SMALL, tokens=20),
]


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize(
    "shape", FAST_SHAPES + [pytest.param(s, marks=pytest.mark.slow) for s in SLOW_SHAPES], ids=str)
def test_kernel_matches_reference(platform, shape):
    for args, expected in batches(shape):
        out = run_kernel(platform, shape, args)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        assert_close(out, expected, shape.dtype)
        assert_blind_rows_zero(out, args)


NARROW_SHAPES = [  # (shape, pool dtype): few, since each costs an interpreter compile
    (Shape(9, 3, 64, 16, "float32", SMALL, tokens=48, max_seqs=6, max_kv=200), "int8"),
    (Shape(8, 2, 64, 8, "bfloat16", tokens=64, max_seqs=6, max_kv=160), "fp8"),
]


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("shape,kv_dtype", NARROW_SHAPES, ids=lambda x: str(x))
def test_kernel_matches_reference_on_narrow_pools(platform, shape, kv_dtype):
    """int8 pages with their scales, fp8 pages; NaN in the junk rows' scales (int8) or values (fp8)."""
    for args, expected in batches(shape, count=2, kv_dtype=kv_dtype):
        assert args[1].dtype == KV_DTYPES[kv_dtype] and len(args) == (10 if kv_dtype == "int8" else 8)
        out = run_kernel(platform, shape, args)
        assert out.dtype == args[0].dtype
        assert_close(out, expected, shape.dtype)
        assert_blind_rows_zero(out, args)
        assert not np.isnan(np.asarray(out, np.float32)).any()


@pytest.mark.parametrize("shape,kv_dtype", NARROW_SHAPES, ids=lambda x: str(x))
def test_reference_reads_narrow_pools_as_their_dequantized_values(shape, kv_dtype):
    reference = jax.jit(ragged_paged_attention_reference)
    for args, expected in batches(shape, count=2, kv_dtype=kv_dtype):
        q, k_pages, v_pages, layer, *metadata = args[:8]
        k_pages, v_pages = (x.astype(jnp.float32) for x in (k_pages, v_pages))
        if kv_dtype == "int8":
            k_pages, v_pages = (x * scale[..., None] for x, scale in zip((k_pages, v_pages), args[8:]))
        assert_close(expected, reference(q, k_pages, v_pages, layer, *metadata), shape.dtype)
        assert float(jnp.abs(expected.astype(jnp.float32)).max()) > 0.1


def test_narrow_pool_needs_its_scales_exactly_for_int8():
    args = batches(NARROW_SHAPES[0][0], count=2, kv_dtype="int8")[0][0]
    with pytest.raises(ValueError, match="k_scale and v_scale must both be given for an int8 pool"):
        ragged_paged_attention(*args[:8])
    with pytest.raises(ValueError, match=r"k_scale must be float32 \(2, 3, 157, 16\)"):
        ragged_paged_attention(*args[:8], args[8][..., :8], args[9])
    with pytest.raises(ValueError, match="must share one dtype of .*'int8', 'float8_e4m3fn'"):
        ragged_paged_attention(args[0], *(x.astype(jnp.float16) for x in args[1:3]), *args[3:8])


@pytest.mark.parametrize("platform", VARIANTS)
def test_junk_in_unused_pages_and_rows_does_not_matter(platform):
    """NaN instead of finite junk in page 0, page tails and unused table entries: same output."""
    shape = Shape(9, 3, 64, 16, "float32", SMALL, tokens=48, max_seqs=6, max_kv=200)
    args, expected = batches(shape, count=2)[1]
    k_pages, v_pages = (jnp.where(x == JUNK, jnp.nan, x) for x in args[1:3])
    out = run_kernel(platform, shape, (args[0], k_pages, v_pages, *args[3:]))
    assert_close(out, expected, shape.dtype)
    assert not np.isnan(np.asarray(out)).any()


@pytest.mark.parametrize("platform", VARIANTS)
def test_layer_is_traced_inside_a_loop_over_layers(platform):
    shape = Shape(8, 2, 64, 16, "float32", tokens=32, max_seqs=4, max_kv=100, layers=3)
    q, k_pages, v_pages, _, *metadata = batches(shape, count=2)[1][0]
    attend = lambda layer, fn, **kw: fn(q, k_pages, v_pages, layer, *metadata, **kw)
    out = jax.jit(lambda: jax.lax.map(
        lambda layer: attend(layer, ragged_paged_attention, platform=platform, interpret=INTERPRET),
        jnp.arange(shape.layers)))()
    for layer in range(shape.layers):
        assert_close(out[layer], attend(layer, ragged_paged_attention_reference), shape.dtype)


@pytest.mark.parametrize("platform", VARIANTS)
def test_attention_reads_the_layer_in_place(platform):
    """The compiled call's scratch memory stays far below one layer of the pool."""
    shape = Shape(8, 2, 64, 16, "float32", tokens=32, max_seqs=4, max_kv=100, layers=4,
                  context_budget=8000)
    args = batches(shape, count=2)[0][0]
    fn = jax.jit(functools.partial(ragged_paged_attention, platform=platform, interpret=INTERPRET))
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < args[1].nbytes / shape.layers / 4


@interpret_only
def test_tpu_dma_schedule_under_the_faithful_interpreter():
    """TPU semantics simulated: DMAs land only at their wait, fresh VMEM holds NaN, races are
    reported; a wait placed too late or a slot reused too early shows up here, not in plain
    interpret mode."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                   uninitialized_memory="nan")
    shape = Shape(8, 2, 64, 16, "float32", SMALL, tokens=40, max_seqs=4, max_kv=120)
    for args, expected in batches(shape, count=2):
        out = ragged_paged_attention(*args, platform="tpu", tuning=SMALL, interpret=params)
        assert_close(out, expected, shape.dtype)
        assert not interpret_pallas_call.races.races_found
    # A sliding window: each sequence's loop starts at a later block, in slot 0.
    (args, expected), = batches(shape, count=2, sliding_window=5)[1:]
    args, poisoned = poison_blocks_before_windows(args, 5)
    out = ragged_paged_attention(*args, platform="tpu", tuning=SMALL, interpret=params,
                                 sliding_window=5)
    assert poisoned > 0 and not np.isnan(np.asarray(out)).any()
    assert_close(out, expected, shape.dtype)
    assert not interpret_pallas_call.races.races_found
    slots = jnp.asarray([17, 18, 40, 3, 99], jnp.int32)
    new = jnp.arange(5 * 2 * 64, dtype=jnp.float32).reshape(5, 2, 64)
    write_args = (args[1], args[2], new, -new, jnp.int32(1), slots)
    for got, want in zip(write_kv(*write_args, platform="tpu", interpret=params),
                         write_kv_reference(*write_args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# (shape, window): SMALL blocks (16 keys) and contexts up to 70, so that most sequences have whole
# KV blocks before their window; decodes and chunks mixed, and a decode-like batch.
WINDOW_CASES = [(Shape(9, 3, 64, 8, "float32", SMALL, tokens=48, max_seqs=6, max_kv=70), window)
                for window in (1, 5, 16)] + [
    (Shape(8, 2, 128, 16, "bfloat16", SMALL, tokens=12, max_seqs=6, max_kv=70), 5)]


def poison_blocks_before_windows(args, window, block_keys=16):
    """args with NaN in every page of a sequence that lies in a KV block of `block_keys` keys wholly
    before the window of the sequence's first token: a kernel that loads one returns NaN (junk V
    rows are zeroed only past kv_len), so this checks that the loops skip them."""
    q, k_pages, v_pages, layer, tables, kv_lens, cu_q_lens, num_seqs = args
    k_pages, v_pages = np.array(k_pages, np.float32), np.array(v_pages, np.float32)
    page_size = k_pages.shape[3]
    poisoned = 0
    for s in range(int(num_seqs[0])):
        first_position = int(kv_lens[s]) - int(cu_q_lens[s + 1] - cu_q_lens[s])
        first_key = max(0, first_position - window + 1)
        pages = np.asarray(tables)[s, :first_key // block_keys * block_keys // page_size]
        k_pages[:, :, pages] = v_pages[:, :, pages] = np.nan
        poisoned += len(pages)
    return (q, jnp.asarray(k_pages, q.dtype), jnp.asarray(v_pages, q.dtype), *args[3:]), poisoned


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("shape,window", WINDOW_CASES, ids=lambda x: str(x))
def test_kernel_matches_reference_with_sliding_window(platform, shape, window):
    """Windows smaller than the contexts; the pages wholly before them are NaN and never read."""
    poisoned = 0
    for args, expected in batches(shape, count=3, sliding_window=window):
        args, count = poison_blocks_before_windows(args, window)
        poisoned += count
        out = run_kernel(platform, shape, args, sliding_window=window)
        assert not np.isnan(np.asarray(out, np.float32)).any()
        assert_close(out, expected, shape.dtype)
        assert_blind_rows_zero(out, args)
    assert poisoned > 0


@interpret_only
@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("shape,window", [(FAST_SHAPES[0], None), WINDOW_CASES[1]], ids=lambda x: str(x))
def test_kernel_matches_reference_with_softcap(platform, shape, window):
    """Gemma 2's soft-capping (a cap of 1.5, below many of these random scores), with a window
    and without; the reference itself against dense numpy."""
    capped = batches(shape, count=2, sliding_window=window, softcap=1.5)
    for args, expected in capped:
        out = run_kernel(platform, shape, args, sliding_window=window, softcap=1.5)
        assert_close(out, expected, shape.dtype)
        assert_blind_rows_zero(out, args)
        if shape.dtype == "float32":
            assert_close(expected, dense_attention(*args, sliding_window=window, softcap=1.5), "float32")
    uncapped = batches(shape, count=2, sliding_window=window)[0][1]   # the same batch, not capped
    assert np.abs(np.asarray(uncapped, np.float32) - np.asarray(capped[0][1], np.float32)).max() > 1e-2


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_reference_matches_dense_numpy_with_sliding_window(window):
    """Contexts up to 300 over 64-key scan steps: the windowed scan runs fewer steps than the
    table has (3 for window 100, against 5), starting per token at its window."""
    shape = Shape(9, 3, 32, 8, "float32", tokens=48, max_seqs=6, max_kv=300)
    for args, expected in batches(shape, count=2, sliding_window=window):
        assert_close(expected, dense_attention(*args, sliding_window=window), "float32")
        assert_blind_rows_zero(expected, args)


def test_sliding_window_is_validated():
    shape = Shape(8, 2, 64, 16, "float32", tokens=16, max_seqs=3, max_kv=40)
    args, expected = batches(shape, count=2)[0]
    for bad in (-1, 2.5, True, "8"):
        for fn in (ragged_paged_attention, ragged_paged_attention_reference):
            with pytest.raises(ValueError, match=rf"sliding_window={bad!r} must be None or 0 "
                                                 r"\(full causal attention\) or an int >= 1"):
                fn(*args, sliding_window=bad)
    for full in (0, shape.pages_per_seq * shape.page_size):  # 0, and a window covering the table
        reference = jax.jit(functools.partial(ragged_paged_attention_reference, sliding_window=full))
        np.testing.assert_array_equal(reference(*args), expected)


@interpret_only
@pytest.mark.parametrize("shape", [Shape(8, 2, 64, 8, "float32", tokens=40, max_seqs=5, max_kv=90),
                                   Shape(9, 3, 32, 16, "float32", tokens=48, max_seqs=6, max_kv=70),
                                   Shape(4, 4, 16, 32, "float32", tokens=24, max_seqs=3, max_kv=120)],
                         ids=str)
def test_reference_matches_dense_numpy(shape):
    for args, expected in batches(shape, count=3):
        assert_close(expected, dense_attention(*args), "float32")


def test_bad_head_counts_are_rejected():
    shape = Shape(8, 2, 64, 16, "float32", tokens=16, max_seqs=3, max_kv=40)
    q, *rest = batches(shape, count=2)[0][0]
    with pytest.raises(ValueError, match="heads=9 must be a multiple of kv_heads=2"):
        ragged_paged_attention(jnp.zeros((16, 9, 64)), *rest)


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("kv_heads,head_dim,page_size,dtype,kv_dtype",
                         [(3, 64, 16, "float32", None), (8, 128, 8, "bfloat16", None),
                          (3, 64, 16, "float32", "int8"), (8, 128, 8, "bfloat16", "fp8")])
def test_write_kv_matches_scatter(platform, kv_heads, head_dim, page_size, dtype, kv_dtype):
    rng = np.random.default_rng(1)
    layers, num_pages, real, padding = 3, 20, 30, 10
    pool_shape = (layers, kv_heads, num_pages, page_size, head_dim)
    pools = [jnp.asarray(rng.standard_normal(pool_shape), dtype) for _ in range(2)]
    scales = []
    if kv_dtype is not None:
        quantized = [quantize_kv(x, KV_DTYPES[kv_dtype]) for x in pools]
        pools, scales = [x for x, _ in quantized], [s for _, s in quantized if s is not None]
    # v spans +-1000: past fp8's 448, where only the clip keeps the cast from NaN.
    k, v = (jnp.asarray(rng.standard_normal((real + padding, kv_heads, head_dim)) * size, dtype)
            for size in (1, 300))
    slots = np.concatenate([rng.permutation(np.arange(page_size, num_pages * page_size))[:real],
                            rng.integers(0, page_size, padding)])  # padding writes into page 0
    args = (*pools, k, v, jnp.int32(1), jnp.asarray(slots, jnp.int32), *scales)
    out = write_kv(*args, platform=platform, tuning=SMALL, interpret=INTERPRET)
    expected = write_kv_reference(*args)
    assert [x.dtype for x in out] == [x.dtype for x in expected] == [x.dtype for x in (*pools, *scales)]
    for got, want in zip(out, expected, strict=True):
        got, want = np.array(got, np.float32), np.array(want, np.float32)
        got[1, :, 0], want[1, :, 0] = 0, 0  # page 0: duplicate writes land in any order
        np.testing.assert_array_equal(got, want)
    if kv_dtype is not None:
        assert_rows_read_back(out, (k, v), slots[:real], page_size, kv_dtype)


def assert_rows_read_back(pools, new, slots, page_size, kv_dtype):
    """The written rows, dequantized, are their values to within half a quantization step."""
    at = (1, slice(None), slots // page_size, slots % page_size)
    for i, x in enumerate(new):
        x = np.asarray(x[:len(slots)], np.float32)
        got = np.asarray(pools[i][at], np.float32)
        if kv_dtype == "int8":
            got = got * np.asarray(pools[2 + i][at])[..., None]
            step = np.abs(x).max(-1, keepdims=True) / 127 / 2
        else:
            x = np.clip(x, -448, 448)
            step = np.maximum(np.abs(x) * 2**-4, 2**-10)
        assert (np.abs(got - x) <= step * 1.001 + 1e-7).all()


@pytest.mark.parametrize("platform", VARIANTS)
def test_write_kv_is_in_place_under_donation(platform):
    pool_shape = (4, 2, 256, 16, 64)
    k_pages = v_pages = jax.ShapeDtypeStruct(pool_shape, jnp.float32)
    k = v = jax.ShapeDtypeStruct((8, 2, 64), jnp.float32)
    fn = jax.jit(functools.partial(write_kv, platform=platform, interpret=INTERPRET), donate_argnums=(0, 1))
    compiled = fn.lower(k_pages, v_pages, k, v, jnp.int32(0), jax.ShapeDtypeStruct((8,), jnp.int32)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < np.prod(pool_shape) * 4 / 16


# --- Lowering for devices we may not have: Mosaic TPU and Triton tiling rules -----------------

MODELS = {  # name: (heads, kv_heads, head_dim, layers, dtype)
    "smollm2": (9, 3, 64, 30, jnp.float32),
    "smollm2-mesh4": (12, 4, 64, 30, jnp.float32),
    "llama3-8b": (32, 8, 128, 32, jnp.bfloat16),
    "llama3-8b-float16": (32, 8, 128, 32, jnp.float16),   # --dtype float16
}
EXPORT_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}


def device_tunings(platform):
    kinds = [key for key, _ in TABLE if ("TPU" in key) == (platform == "tpu") and key != "cpu"]
    return sorted({tuning_for(kind) for kind in kinds} | {Tuning()}, key=repr)


def export(fn, platform, *args):
    return jax.export.export(
        jax.jit(fn), platforms=[EXPORT_PLATFORM[platform]],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


# (model, tokens, pool dtype, sliding window, softcap): every model at decode and prefill sizes;
# narrow pools at decode; a sliding window at prefill; Gemma 2's window and soft-capping at decode.
LOWERINGS = ([(model, tokens, "auto", None, None) for model in MODELS for tokens in (8, 512)]
             + [(model, 8, kv, None, None) for model in ("smollm2", "llama3-8b") for kv in KV_DTYPES]
             + [("llama3-8b", 512, "auto", 1000, None), ("llama3-8b", 8, "auto", 4096, 50.0)])


@interpret_only
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("model,tokens,kv_dtype,window,softcap", LOWERINGS, ids=lambda x: str(x))
def test_kernels_lower_for_the_device(platform, model, tokens, kv_dtype, window, softcap):
    heads, kv_heads, head_dim, layers, dtype = MODELS[model]
    seqs, page_size, num_pages, pages_per_seq = 8, 16, 1024, 128
    spec = jax.ShapeDtypeStruct
    pool_shape = (layers, kv_heads, num_pages, page_size)
    pool = spec((*pool_shape, head_dim), KV_DTYPES.get(kv_dtype, dtype))
    scales = (spec(pool_shape, jnp.float32),) * 2 if kv_dtype == "int8" else ()
    i32 = lambda *dims: spec(dims, jnp.int32)
    attention_args = (spec((tokens, heads, head_dim), dtype), pool, pool, i32(), i32(seqs, pages_per_seq),
                      i32(seqs), i32(seqs + 1), i32(1), *scales)
    new_kv = spec((tokens, kv_heads, head_dim), dtype)
    write_args = (pool, pool, new_kv, new_kv, i32(), i32(tokens), *scales)
    for tuning in device_tunings(platform):
        kw = dict(platform=platform, tuning=tuning, interpret=False)
        attention = export(functools.partial(ragged_paged_attention, sliding_window=window, softcap=softcap,
                                             **kw),
                           platform, *attention_args)
        written = export(functools.partial(write_kv, **kw), platform, *write_args)
        target = "tpu_custom_call" if platform == "tpu" else "triton"
        assert target in attention.mlir_module() and target in written.mlir_module()
        assert len(written.out_avals) == 2 + len(scales)
