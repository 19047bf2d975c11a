"""The two ways of computing LoRA deltas (jaxserve/models/layers/lora.py), timed at a model's
projection shapes: dense (every slot's columns, the others masked) against ragged
(`jax.lax.ragged_dot` over tokens sorted by slot), for several step sizes and slot counts.

    python tools/bench_lora.py                      # SmolLM2's 576 -> 1536 projection, rank 16
    python tools/bench_lora.py --in 4096 --out 14336 --rank 16

Prints a table of milliseconds per call (median of --repeat) and which is faster; DENSE_MAX_COLUMNS
in lora.py is set from it. Beside them: `base`, the projection the delta is added to (x @ W), and
`own`, every token against one slot's R columns only (x @ A[s] @ B[s]): what a grouped matmul that
gives each token its own adapter would cost, the floor neither form reaches. `kept` is the share
of the projection's speed left with the faster form, base / (base + delta).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.layers.lora import dense_delta, ragged_delta


def timed(fn, *args, repeat: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in", dest="in_features", type=int, default=576)
    parser.add_argument("--out", dest="out_features", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--slots", type=int, nargs="+", default=[2, 3, 5, 9, 17], help="slot 0 included")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    dense, ragged = jax.jit(dense_delta), jax.jit(ragged_delta)
    base, own = jax.jit(lambda x, w: x @ w), jax.jit(lambda x, a, b: (x @ a) @ b)
    w = jnp.asarray(rng.normal(size=(args.in_features, args.out_features)).astype(np.float32))
    print(f"projection {args.in_features} -> {args.out_features}, rank {args.rank}; ms per call")
    print(f"{'tokens':>7}{'slots':>7}{'columns':>9}{'dense':>10}{'ragged':>10}{'base':>10}{'own':>10}"
          f"{'kept':>7}  faster")
    for num_slots in args.slots:
        a = rng.normal(size=(args.in_features, num_slots, args.rank)).astype(np.float32)
        b = rng.normal(size=(num_slots, args.rank, args.out_features)).astype(np.float32)
        a[:, 0], b[0] = 0, 0   # slot 0 is "no adapter"
        a, b = jnp.asarray(a), jnp.asarray(b)
        for num_tokens in args.tokens:
            x = jnp.asarray(rng.normal(size=(num_tokens, args.in_features)).astype(np.float32))
            slots = jnp.asarray(rng.integers(0, num_slots, num_tokens).astype(np.int32))
            np.testing.assert_allclose(dense(x, a, b, slots), ragged(x, a, b, slots), rtol=1e-4, atol=1e-3)
            d, r = timed(dense, x, a, b, slots, repeat=args.repeat), timed(ragged, x, a, b, slots, repeat=args.repeat)
            p = timed(base, x, w, repeat=args.repeat)
            o = timed(own, x, a[:, -1], b[-1], repeat=args.repeat)
            print(f"{num_tokens:>7}{num_slots:>7}{num_slots * args.rank:>9}{d:>10.3f}{r:>10.3f}{p:>10.3f}{o:>10.3f}"
                  f"{p / (p + min(d, r)):>7.2f}  {'dense' if d <= r else 'ragged'}")


if __name__ == "__main__":
    main()
