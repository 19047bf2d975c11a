"""Times the ragged paged attention kernel against the jnp reference (and, on a device that has
them, JAX's own Pallas paged-attention decode kernels), and reports achieved bandwidth.

Bandwidth counts the bytes a kernel must move at least: every sequence's K/V context once, plus
q and out; it is shown as a fraction of the device's copy bandwidth (a large jnp array copy,
read + write). Times are medians of --runs warm, jitted calls, each ended by block_until_ready.

  python tools/bench_kernels.py            # device shapes: decode- and prefill-heavy
  python tools/bench_kernels.py --quick    # small shapes; on CPU runs interpreted
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention, ragged_paged_attention_reference, write_kv, write_kv_reference)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]   # new tokens per sequence
    kv_lens: tuple[int, ...]  # context per sequence, new tokens included
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int = 16
    layers: int = 2

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.q_lens)


def batch(n, q_len, kv_len):
    return (q_len,) * n, (kv_len,) * n


FULL = [
    Case("decode b64 ctx2048 32/8 d128", *batch(64, 1, 2048), 32, 8, 128, "bfloat16"),
    Case("decode b64 ctx1024 9/3 d64 f32", *batch(64, 1, 1024), 9, 3, 64, "float32"),
    Case("prefill 4x512 ctx1024 32/8 d128", *batch(4, 512, 1024), 32, 8, 128, "bfloat16"),
    Case("mixed 32 decodes ctx1024 + 512 chunk", (1,) * 32 + (512,), (1024,) * 32 + (1536,),
         32, 8, 128, "bfloat16"),
]
QUICK = [
    Case("decode b8 ctx100 9/3 d64 f32", *batch(8, 1, 100), 9, 3, 64, "float32"),
    Case("decode b4 ctx256 8/2 d128 bf16", *batch(4, 1, 256), 8, 2, 128, "bfloat16"),
    Case("prefill 2x128 ctx256 9/3 d64 f32", *batch(2, 128, 256), 9, 3, 64, "float32"),
]


def make_inputs(case: Case, seed: int = 0):
    """Kernel arguments with every sequence's pages shuffled through the pool (page 0 spare)."""
    rng = np.random.default_rng(seed)
    seqs = len(case.q_lens)
    pages_per_seq = -(-max(case.kv_lens) // case.page_size)
    pages_per_seq = -(-pages_per_seq // 8) * 8  # JAX's TPU decode kernel wants a multiple of its block
    num_pages = 1 + seqs * pages_per_seq
    dtype = jnp.dtype(case.dtype)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    pool_shape = (case.layers, case.kv_heads, num_pages, case.page_size, case.head_dim)
    tables = rng.permutation(np.arange(1, num_pages)).reshape(seqs, pages_per_seq)
    cu_q_lens = np.concatenate([[0], np.cumsum(case.q_lens)])
    return (jax.random.normal(key_q, (int(cu_q_lens[-1]), case.heads, case.head_dim), dtype),
            jax.random.normal(key_k, pool_shape, dtype), jax.random.normal(key_v, pool_shape, dtype),
            jnp.int32(case.layers - 1), jnp.asarray(tables, jnp.int32),
            jnp.asarray(case.kv_lens, jnp.int32), jnp.asarray(cu_q_lens, jnp.int32),
            jnp.asarray([seqs], jnp.int32))


def min_bytes(case: Case) -> int:
    item = jnp.dtype(case.dtype).itemsize
    kv = 2 * sum(case.kv_lens) * case.kv_heads * case.head_dim * item
    return kv + 2 * sum(case.q_lens) * case.heads * case.head_dim * item


def median_seconds(fn, args, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(runs: int, megabytes: int) -> float:
    """Bytes/s of a large array copy (read + write)."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    seconds = median_seconds(jax.jit(jnp.copy), (x,), runs)
    return 2 * x.nbytes / seconds


def jax_ops_decode(case: Case, backend: str):
    """JAX's own Pallas decode kernel for this device, on one layer's pool, or None."""
    if not case.decode_only:
        return None
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
        attend = lambda q, k, v, tables, lens: paged_attention(q, k, v, lens, tables,
                                                               pages_per_compute_block=8)
    elif backend in ("gpu", "cpu"):  # on CPU interpreted, so that this path is checked here too
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        def attend(q, k, v, tables, lens):
            # Split-K partitions of whole 8-page compute blocks: at most 16, dividing the table.
            blocks = tables.shape[1] // 8
            splits = max(s for s in (1, 2, 4, 8, 16) if blocks % s == 0)
            return paged_attention(q, k, v, tables, lens, k_splits=splits, pages_per_compute_block=8,
                                   interpret=backend == "cpu")
    else:
        return None
    # The layer is sliced before timing: these kernels take a single-layer pool.
    return lambda q, k_layer, v_layer, tables, lens: attend(q, k_layer, v_layer, tables, lens)


def bench_case(case: Case, args, runs: int, copy_bps: float, platform):
    kernel = jax.jit(functools.partial(ragged_paged_attention, platform=platform))
    reference = jax.jit(ragged_paged_attention_reference)
    out, expected = kernel(*args), reference(*args)
    error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
    rows = [("kernel", median_seconds(kernel, args, runs), error),
            ("reference", median_seconds(reference, args, runs), 0.0)]
    ops = jax_ops_decode(case, jax.default_backend())
    if ops is not None:
        q, k_pages, v_pages, layer, tables, kv_lens = args[:6]
        # These kernels leave the 1/sqrt(head_dim) scale to the caller.
        ops_args = (q * case.head_dim ** -0.5, k_pages[layer], v_pages[layer], tables, kv_lens)
        try:
            ops_fn = jax.jit(ops)
            ops_error = float(jnp.max(jnp.abs(ops_fn(*ops_args).astype(jnp.float32)
                                              - expected.astype(jnp.float32))))
            rows.append(("jax ops decode", median_seconds(ops_fn, ops_args, runs), ops_error))
        except Exception as error:  # a shape the library kernel does not take
            print(f"  jax ops decode kernel skipped: {type(error).__name__}: {str(error)[:120]}")
    bytes_moved = min_bytes(case)
    for name, seconds, err in rows:
        achieved = bytes_moved / seconds
        print(f"  {name:<16} {seconds * 1e3:9.3f} ms  {achieved / 1e9:8.2f} GB/s  "
              f"{achieved / copy_bps:6.1%} of copy  max|err| {err:.2e}")


def bench_write(case: Case, args, runs: int, platform):
    q, k_pages, v_pages, layer = args[:4]
    tokens = q.shape[0]
    k_new = jnp.ones((tokens, case.kv_heads, case.head_dim), k_pages.dtype)
    slots = jnp.arange(tokens, dtype=jnp.int32) + case.page_size  # past page 0
    for name, fn in (("write_kv kernel", functools.partial(write_kv, platform=platform)),
                     ("write_kv scatter", write_kv_reference)):
        step = jax.jit(fn, donate_argnums=(0, 1))
        pools = [jnp.copy(k_pages), jnp.copy(v_pages)]

        def once():
            pools[:] = step(pools[0], pools[1], k_new, k_new, layer, slots)
            return pools[0]

        seconds = median_seconds(lambda: once(), (), runs)
        print(f"  {name:<16} {seconds * 1e3:9.3f} ms  ({tokens} tokens, pool donated)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU: interpreted)")
    parser.add_argument("--runs", type=int, default=20, help="warm calls per measurement (median)")
    parser.add_argument("--platform", choices=["tpu", "gpu"], default=None,
                        help="kernel variant (default: from the backend; CPU runs the TPU one)")
    parser.add_argument("--copy-mb", type=int, default=None, help="size of the bandwidth-probe copy")
    args = parser.parse_args(argv)
    cases = QUICK if args.quick else FULL
    device = jax.devices()[0]
    copy_bps = copy_bandwidth(args.runs, args.copy_mb or (64 if args.quick else 1024))
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"copy bandwidth {copy_bps / 1e9:.1f} GB/s (read + write)")
    for case in cases:
        print(f"{case.name}: tokens {sum(case.q_lens)}, seqs {len(case.q_lens)}, {case.dtype}, "
              f"{min_bytes(case) / 2**20:.1f} MiB moved at least")
        inputs = make_inputs(case)
        bench_case(case, inputs, args.runs, copy_bps, args.platform)
        bench_write(case, inputs, args.runs, args.platform)


if __name__ == "__main__":
    main()
