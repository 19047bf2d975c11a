"""LoRA adapters on the device: every resident adapter's A and B in slots, and the delta they add to
a projection for each token of a step, whichever adapter its sequence runs with.

    a [layers, in, slots, R]   b [layers, slots, R, out]   (per adapted projection)

Slot 0 is all zeros ("no adapter"); slots 1.. hold the adapters the engine made resident, padded
to R = max_lora_rank with zero columns (A) and rows (B), scaling folded into B. A keeps its
input axis first so that one layer's A of every slot is a plain [in, slots * R] matrix (a slot
axis in front would make XLA transpose A before every dot: 30% of the delta's time on the CPU).
Every token of a step carries its sequence's slot (`lora_slots` [T] int32). Loading an adapter
into a slot overwrites that slot in place (`load_slot`, the arrays donated): no program is
recompiled.

The delta of a projection, `(x @ A[slot]) @ B[slot]`, is computed for all tokens at once in one
of two ways, exact alike (chosen by `delta`, see its docstring):
  dense   x against every adapter slot's A ([T, (slots - 1) * R]), the columns of other slots
          zeroed, then against their B: two matmuls of `(slots - 1) * R` columns, no data movement;
  ragged  tokens sorted by slot, `jax.lax.ragged_dot` over the groups: each token meets only its
          own slot's R columns, at the cost of a gather and a scatter of the step's activations.
A step without adapted tokens skips the deltas (`lax.cond`). The slot arrays are not scanned over
with the layers: each layer slices its own inside that cond, so such a step never touches them
(sliced outside, XLA copies every layer's slots each step, adapted or not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Above this many slot columns (slots * R) the ragged form is used. tools/bench_lora.py on the CPU
# (2026-12-04, SmolLM2's 576 -> 1536, rank 16, A input axis first): dense was faster from 16
# tokens up, to 17 slots (272 columns): 3.4 against 8.2 ms at 512 tokens, 0.53 against 0.76 at 16;
# ragged only at a single token (0.08 against 0.15 ms at 5 slots), where the step is small anyway
# (XLA's CPU ragged_dot is a loop over groups). On TPU/GPU it is unmeasured (tools/gpu_check.sh
# runs the tool).
DENSE_MAX_COLUMNS = 512


def delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in], a [in, S, R], b [S, R, out], slots [T] int32 -> [T, out]: each token's adapter
    delta (zeros for slot 0). Dense while S * R <= DENSE_MAX_COLUMNS, else ragged (static shapes:
    the choice is made when the step is traced)."""
    _, num_slots, rank = a.shape
    if num_slots * rank <= DENSE_MAX_COLUMNS:
        return dense_delta(x, a, b, slots)
    return ragged_delta(x, a, b, slots)


def dense_delta(x, a, b, slots):
    a, b = a[:, 1:], b[1:]   # slot 0 is zeros: its columns would only cost time
    in_features, num_slots, rank = a.shape
    xa = (x @ a.reshape(in_features, num_slots * rank)).reshape(-1, num_slots, rank)
    mine = (slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]).astype(x.dtype)
    return (xa * mine[:, :, None]).reshape(-1, num_slots * rank) @ b.reshape(num_slots * rank, -1)


def ragged_delta(x, a, b, slots):
    order = jnp.argsort(slots)
    sizes = jnp.bincount(slots, length=a.shape[1]).astype(jnp.int32)
    xa = jax.lax.ragged_dot(x[order], jnp.transpose(a, (1, 0, 2)), sizes)
    return jnp.zeros((x.shape[0], b.shape[-1]), x.dtype).at[order].set(jax.lax.ragged_dot(xa, b, sizes))


def adapted(x: jax.Array, adapters, names: tuple[str, ...], ys: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """ys (the projections `names` of x) plus their adapter deltas. `adapters`: (every layer's slot
    arrays by module, this layer's index, the tokens' slots, whether any token has an adapter), or
    None without LoRA. One `lax.cond` for the projections of one input (q, k and v; gate and up):
    a cond costs about as much on the CPU as a small delta."""
    if adapters is None or not any(name in adapters[0] for name in names):
        return ys
    weights, layer, slots, any_adapted = adapters

    def with_deltas():
        out = []
        for name, y in zip(names, ys):
            if name in weights:
                a, b = (jax.lax.dynamic_index_in_dim(w, layer, keepdims=False) for w in weights[name])
                y = y + delta(x, a, b, slots).astype(y.dtype)
            out.append(y)
        return tuple(out)

    return jax.lax.cond(any_adapted, with_deltas, lambda: tuple(ys))


def allocate(shapes: dict[str, tuple[int, int]], num_layers: int, num_slots: int, rank: int, dtype,
             sharding_for=None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Zero slots for each module of `shapes` (module -> [in, out]); `sharding_for(path, shape)`
    places each array on a mesh."""
    weights = {}
    for module, (in_features, out_features) in shapes.items():
        pair = []
        for part, shape in (("a", (num_layers, in_features, num_slots, rank)),
                            ("b", (num_layers, num_slots, rank, out_features))):
            sharding = sharding_for(f"lora/{module}/{part}", shape) if sharding_for else None
            pair.append(jax.jit(lambda s=shape: jnp.zeros(s, dtype), out_shardings=sharding)())
        weights[module] = tuple(pair)
    return weights


def _load(weights, slot, new):
    return {m: (a.at[:, :, slot].set(new[m][0].astype(a.dtype)), b.at[:, slot].set(new[m][1].astype(b.dtype)))
            for m, (a, b) in weights.items()}


load_slot = jax.jit(_load, donate_argnums=(0,))   # (weights, slot, {module: (a [L, in, R], b [L, R, out])})


def padded(modules: dict[str, tuple[np.ndarray, np.ndarray]], shapes: dict[str, tuple[int, int]], num_layers: int,
           rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """An adapter's modules as one slot's arrays: every module of `shapes`, zeros where it has
    none, A's columns and B's rows padded to `rank`."""
    out = {}
    for module, (in_features, out_features) in shapes.items():
        a = np.zeros((num_layers, in_features, rank), np.float32)
        b = np.zeros((num_layers, rank, out_features), np.float32)
        if module in modules:
            got_a, got_b = modules[module]
            a[:, :, :got_a.shape[2]] = got_a
            b[:, :got_b.shape[1], :] = got_b
        out[module] = (a, b)
    return out
