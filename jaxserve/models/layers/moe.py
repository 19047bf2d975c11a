"""Mixture of experts: a softmax top-k router and SwiGLU experts stored as stacked weights.

The step's (token, choice) pairs are sorted by expert so that each expert's rows are contiguous,
and every projection is one `jax.lax.ragged_dot` over those groups (on a CPU, where XLA's
ragged_dot runs every expert, a loop over tiles of rows within one expert): compute grows with
the tokens times k, not with the number of experts. `dense_experts` (every token through every
expert, a one-hot weighted sum) is the plain reference the tests hold it to.

Expert parallelism: on a mesh the experts are split over the `model` axis (the partition rule
table says so). Tokens are already replicated over `model` (tensor parallelism keeps activations
whole between layers), so no token moves: each device runs the pairs routed to its own experts,
and one sum over `model` combines them, the same all-reduce a row-parallel projection ends with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.models.layers.linear import dequantize_parts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """One projection of every expert, `[experts, in, out]`: float, or a quantized weight's parts
    (linear.py) each with a leading expert axis, dequantised right before its dot."""

    value: jax.Array
    scale: jax.Array | None = None
    minimum: jax.Array | None = None
    kind: str = dataclasses.field(default="float", metadata=dict(static=True))   # or int8 | fp8 | uint4

    def _parts(self, index):
        return tuple(None if p is None else p[index] for p in (self.value, self.scale, self.minimum))

    def one(self, expert, dtype) -> jax.Array:
        """Expert `expert`'s `[in, out]`."""
        if self.kind == "float":
            return self.value[expert]
        return dequantize_parts(self.kind, *self._parts(expert), dtype)

    def take(self, experts: jax.Array, dtype) -> jax.Array:
        """experts [N] -> [N, in, out]."""
        if self.kind == "float":
            return self.value[experts]
        return jax.vmap(lambda *parts: dequantize_parts(self.kind, *parts, dtype))(*self._parts(experts))

    def whole(self, dtype) -> jax.Array:
        return self.take(jnp.arange(self.value.shape[0]), dtype)


def as_stack(w) -> ExpertStack:
    return w if isinstance(w, ExpertStack) else ExpertStack(jnp.asarray(w))


def route(h: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """h [T, hidden], router [hidden, experts] -> (weights [T, k] float32, expert ids [T, k] int32):
    the k largest softmax probabilities, renormalised to sum to 1 when `normalize` (Mixtral,
    Qwen's `norm_topk_prob`)."""
    probs = jax.nn.softmax((h @ router).astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def default_method() -> str:
    """`ragged` (`jax.lax.ragged_dot`: TPU and GPU kernels) except on a CPU, where XLA's
    ragged_dot costs about as much as running every expert (tools/bench_moe.py): `tiled` there."""
    return "tiled" if jax.default_backend() == "cpu" else "ragged"


def routed_experts(x, weights, ids, gate, up, down, first_expert=0, method: str | None = None) -> jax.Array:
    """The weighted sum of the experts `first_expert ... first_expert + E - 1` over the pairs routed
    to them. x [T, hidden]; weights, ids [T, k]; gate, up [E, hidden, ffn]; down [E, ffn, hidden].
    Pairs routed to other experts add nothing (another device holds those). `method`: how the
    grouped rows meet their experts, `ragged` or `tiled` (None: `default_method()`); `tiled`
    runs each pair through its expert one at a time instead when there are no more pairs than
    experts."""
    method = method or default_method()
    gate, up, down = as_stack(gate), as_stack(up), as_stack(down)
    top_k = ids.shape[1]
    num_local = gate.value.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                      # pairs grouped by expert
    # pairs per local expert (one_hot of another device's expert is all zeros)
    counts = jnp.sum(jax.nn.one_hot(flat - first_expert, num_local, dtype=jnp.int32), axis=0)
    start = jnp.sum(flat < first_expert)                        # sorted pairs before the first local expert
    pairs = order[(jnp.arange(flat.shape[0]) + start) % flat.shape[0]]   # local experts' pairs first
    rows = x[pairs // top_k]
    if method == "ragged":
        out = ragged_mlp(rows, counts, gate, up, down)
    elif flat.shape[0] <= num_local:   # a few pairs (decodes): each reads its own expert's weights
        out = per_pair_mlp(rows, jnp.clip(flat[pairs] - first_expert, 0, num_local - 1), gate, up, down)
    else:
        out = tiled_mlp(rows, counts, gate, up, down)
    scale = jnp.where(jnp.arange(flat.shape[0]) < jnp.sum(counts), weights.reshape(-1)[pairs], 0.0)
    # back to (token, choice) order, then each token's k rows summed: the same order of additions
    # whatever else is in the batch (a scatter-add's order is not fixed)
    unsorted = jnp.zeros_like(out).at[pairs].set(out * scale[:, None].astype(out.dtype))
    return jnp.sum(unsorted.reshape(-1, top_k, out.shape[-1]), axis=1)


def ragged_mlp(rows, counts, gate, up, down) -> jax.Array:
    """rows [N, hidden] grouped by expert, counts [E] rows per expert (rows past their sum give 0)."""
    gate, up, down = (w.whole(rows.dtype) for w in (gate, up, down))
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, counts)) * jax.lax.ragged_dot(rows, up, counts)
    return jax.lax.ragged_dot(h.astype(rows.dtype), down, counts)


def per_pair_mlp(rows, expert_of_row, gate, up, down) -> jax.Array:
    """Each row through its own expert, one row at a time: for no more rows than experts. A loop
    rather than a gather of every row's expert weights, which XLA's CPU gather copied element by
    element (8 rows of 8 experts at tools/bench_moe.py's shapes: 22.7 ms gathered, 3.3 ms here).
    Rows of another device's experts are computed with a stand-in and zeroed by the caller."""

    def one_row(i, out):
        expert = expert_of_row[i]
        x = jax.lax.dynamic_slice_in_dim(rows, i, 1)
        h = jax.nn.silu(x @ gate.one(expert, x.dtype)) * (x @ up.one(expert, x.dtype))
        return jax.lax.dynamic_update_slice_in_dim(out, h.astype(x.dtype) @ down.one(expert, x.dtype), i, 0)

    return jax.lax.fori_loop(0, rows.shape[0], one_row, jnp.zeros_like(rows))


def tiled_mlp(rows, counts, gate, up, down) -> jax.Array:
    """`ragged_mlp` as a loop over tiles of `tile` rows, each within one expert: only the tiles
    that hold rows run (a decode of k pairs reads k experts, not all), each one expert's SwiGLU on
    dense dots. A tile's rows past its expert's are masked: every row gets exactly one value."""
    num_rows, hidden = rows.shape
    tile = min(64, -(-2 * num_rows // counts.shape[0] // 8) * 8)   # ~ twice an even share of the rows
    tiles_of = -(-counts // tile)                                    # [E] tiles per expert
    first_tile = jnp.cumsum(tiles_of) - tiles_of
    first_row = jnp.cumsum(counts) - counts
    padded = jnp.zeros((num_rows + tile, hidden), rows.dtype).at[:num_rows].set(rows)

    def run_tile(t, out):
        expert = jnp.sum(first_tile + tiles_of <= t)                # the expert tile t belongs to
        within = (t - first_tile[expert]) * tile
        start = first_row[expert] + within
        x = jax.lax.dynamic_slice_in_dim(padded, start, tile)
        h = jax.nn.silu(x @ gate.one(expert, x.dtype)) * (x @ up.one(expert, x.dtype))
        y = (h.astype(x.dtype) @ down.one(expert, x.dtype)) * (jnp.arange(tile) < counts[expert] - within)[:, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.dynamic_slice_in_dim(out, start, tile) + y, start, 0)

    out = jax.lax.fori_loop(0, jnp.sum(tiles_of), run_tile, jnp.zeros_like(padded))
    return out[:num_rows]


def dense_experts(x, weights, ids, gate, up, down) -> jax.Array:
    """The reference: every token through every expert, weighted by its one-hot routing."""
    gate, up, down = (as_stack(w).whole(x.dtype) for w in (gate, up, down))
    mix = jnp.sum(jax.nn.one_hot(ids, gate.shape[0], dtype=jnp.float32) * weights[..., None], axis=1)   # [T, E]
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, gate)) * jnp.einsum("td,edf->tef", x, up)
    return jnp.einsum("tef,efd,te->td", h, down, mix.astype(x.dtype))


def experts(x, weights, ids, gate, up, down, mesh: Mesh | None) -> jax.Array:
    """`routed_experts` over all experts; on a mesh each device takes its `model` slice of them
    and its `data` slice of the tokens."""
    if mesh is None:
        return routed_experts(x, weights, ids, gate, up, down)
    tokens, split = P("data"), P("model")
    return jax.shard_map(functools.partial(_expert_shard, mesh.shape["model"]), mesh=mesh,
                         in_specs=(tokens, tokens, tokens, split, split, split), out_specs=tokens)(
        x, weights, ids, gate, up, down)


def _expert_shard(model_size: int, x, weights, ids, gate, up, down):
    first = jax.lax.axis_index("model") * gate.value.shape[0]
    partial = routed_experts(x, weights, ids, gate, up, down, first)
    return jax.lax.psum(partial, "model") if model_size > 1 else partial
