"""LoRA adapters on the device: every resident adapter's A and B in slots, and the delta they add to
a projection for each token of a step, whichever adapter its sequence runs with.

    a [layers, slots, in, R]   b [layers, slots, R, out]   (per adapted projection)

Slot 0 is all zeros ("no adapter"); slots 1.. hold the adapters the engine made resident, padded
to R = max_lora_rank with zero columns (A) and rows (B), scaling folded into B. Every token of a
step carries its sequence's slot (`lora_slots` [T] int32). Loading an adapter into a slot
overwrites that slot in place (`load_slot`, the arrays donated): no program is recompiled.

The delta of a projection, `(x @ A[slot]) @ B[slot]`, is computed for all tokens at once in one
of two ways, exact alike (chosen by `delta`, see its docstring):
  dense   x against every adapter slot's A ([T, (slots - 1) * R]), the columns of other slots
          zeroed, then against their B: two matmuls of `(slots - 1) * R` columns, no data movement;
  ragged  tokens sorted by slot, `jax.lax.ragged_dot` over the groups: each token meets only its
          own slot's R columns, at the cost of a gather and a scatter of the step's activations.
A step without adapted tokens skips the delta (`lax.cond`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Above this many slot columns (slots * R) the ragged form is used. tools/bench_lora.py on the CPU
# (2026-12-03, SmolLM2's 576 -> 1536, rank 16): dense was faster at every size tried, up to 17
# slots (272 columns): 3.8 against 8.3 ms at 512 tokens, 0.2 against 0.25 ms at one (XLA's CPU
# ragged_dot is a loop over groups). Ragged only pays where dense work grows with many slots;
# on TPU/GPU it is unmeasured (tools/gpu_check.sh runs the tool).
DENSE_MAX_COLUMNS = 512


def delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in], a [S, in, R], b [S, R, out], slots [T] int32 -> [T, out]: each token's adapter
    delta (zeros for slot 0). Dense while S * R <= DENSE_MAX_COLUMNS, else ragged (static shapes:
    the choice is made when the step is traced)."""
    num_slots, _, rank = a.shape
    if num_slots * rank <= DENSE_MAX_COLUMNS:
        return dense_delta(x, a, b, slots)
    return ragged_delta(x, a, b, slots)


def dense_delta(x, a, b, slots):
    a, b = a[1:], b[1:]   # slot 0 is zeros: its columns would only cost time
    xa = jnp.einsum("ti,sir->tsr", x, a)
    mine = (slots[:, None] == jnp.arange(1, a.shape[0] + 1)[None, :]).astype(x.dtype)
    return jnp.einsum("tsr,sro->to", xa * mine[:, :, None], b)


def ragged_delta(x, a, b, slots):
    order = jnp.argsort(slots)
    sizes = jnp.bincount(slots, length=a.shape[0]).astype(jnp.int32)
    xa = jax.lax.ragged_dot(x[order], a, sizes)
    return jnp.zeros((x.shape[0], b.shape[-1]), x.dtype).at[order].set(jax.lax.ragged_dot(xa, b, sizes))


def adapted(x: jax.Array, layer_slots, module: str, y: jax.Array) -> jax.Array:
    """y (a projection of x) plus its adapter delta; `layer_slots`: (this layer's slot arrays by
    module, the tokens' slots, whether any token has an adapter) or None without LoRA."""
    if layer_slots is None or module not in layer_slots[0]:
        return y
    weights, slots, any_adapted = layer_slots
    a, b = weights[module]
    return jax.lax.cond(any_adapted, lambda: y + delta(x, a, b, slots).astype(y.dtype), lambda: y)


def allocate(shapes: dict[str, tuple[int, int]], num_layers: int, num_slots: int, rank: int, dtype,
             sharding_for=None) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Zero slots for each module of `shapes` (module -> [in, out]); `sharding_for(path, shape)`
    places each array on a mesh."""
    weights = {}
    for module, (in_features, out_features) in shapes.items():
        pair = []
        for part, shape in (("a", (num_layers, num_slots, in_features, rank)),
                            ("b", (num_layers, num_slots, rank, out_features))):
            sharding = sharding_for(f"lora/{module}/{part}", shape) if sharding_for else None
            pair.append(jax.jit(lambda s=shape: jnp.zeros(s, dtype), out_shardings=sharding)())
        weights[module] = tuple(pair)
    return weights


def _load(weights, slot, new):
    return {m: (a.at[:, slot].set(new[m][0].astype(a.dtype)), b.at[:, slot].set(new[m][1].astype(b.dtype)))
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
