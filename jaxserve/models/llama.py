"""The Llama-architecture decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3,
and with a mixture of experts Mixtral, Qwen2-MoE, Qwen3-MoE) in Flax NNX.

All layers' weights are stacked on a leading axis and the layers run under `jax.lax.scan`, so a
program compiles in about the time of one layer whatever the depth. Weights are created abstractly
(`nnx.eval_shape`) and filled from a checkpoint; nothing here initialises random weights.
Linear weights are stored `[in, out]`, as float arrays or as quantized weights
(`jaxserve.models.layers.linear`), chosen per weight by `formats`. Experts are stacked
`[experts, in, out]` (float, or quantized with every part stacked), split over the mesh's
`model` axis (`jaxserve.models.layers.moe`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.models.layers import lora
from jaxserve.models.layers.attention import AttentionBackend, AttentionMetadata, KVPages
from jaxserve.models.layers.linear import QuantizedWeight, WeightFormat, Weight, embed_lookup, lm_head, matmul
from jaxserve.models.layers.moe import ExpertStack, experts, route
from jaxserve.models.layers.norm import gemma_rms_norm, rms_norm
from jaxserve.models.layers.rope import apply_rope, rope_for


def _param(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def _maybe(flag: bool, shape: tuple[int, ...], dtype) -> nnx.Param | None:
    return _param(shape, dtype) if flag else None


VOCAB_MAJOR = ("embed", "lm_head")   # stored [vocab, hidden] when quantized (see linear.py)


# Weights that may be quantized: parameter path -> its [in, out] shape.
def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, q_dim, kv_dim, ffn = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                             cfg.intermediate_size)
    shapes = {"layers/q_proj": (d, q_dim), "layers/k_proj": (d, kv_dim), "layers/v_proj": (d, kv_dim),
              "layers/o_proj": (q_dim, d), "embed": (d, cfg.vocab_size)}
    if ffn:   # the dense MLP, or a mixture of experts' shared expert
        shapes.update({"layers/gate_proj": (d, ffn), "layers/up_proj": (d, ffn), "layers/down_proj": (ffn, d)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Expert weights that may be quantized: parameter path -> one expert's [in, out]."""
    if not cfg.num_experts:
        return {}
    d, ffn = cfg.hidden_size, cfg.moe_intermediate_size
    return {"layers/gate_experts": (d, ffn), "layers/up_experts": (d, ffn), "layers/down_experts": (ffn, d)}


def lora_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The projections a LoRA adapter may adapt: module name -> [in, out]."""
    return {path.removeprefix("layers/"): shape for path, shape in linear_shapes(cfg).items()
            if path.startswith("layers/")}


def _weight(path: str, cfg: ModelConfig, dtype, formats: dict[str, WeightFormat]) -> Weight:
    """A float `[in, out]` parameter, or a quantized weight when `formats` names `path`."""
    in_features, out_features = linear_shapes(cfg)[path]
    if path in formats:
        return QuantizedWeight(formats[path], in_features, out_features, vocab_major=path in VOCAB_MAJOR)
    return _param((out_features, in_features) if path == "embed" else (in_features, out_features), dtype)


def _expert_weight(path: str, cfg: ModelConfig, dtype, formats: dict[str, WeightFormat]) -> Weight:
    """A float `[experts, in, out]` parameter, or a quantized weight per expert, stacked."""
    in_features, out_features = expert_shapes(cfg)[path]
    if path in formats:
        return nnx.vmap(lambda: QuantizedWeight(formats[path], in_features, out_features),
                        axis_size=cfg.num_experts)()
    return _param((cfg.num_experts, in_features, out_features), dtype)


def _stack(w: Weight) -> ExpertStack:
    if isinstance(w, nnx.Param):
        return ExpertStack(w[...])
    return ExpertStack(*w.parts(), kind=w.fmt.kind)


class DecoderLayer(nnx.Module):
    """One pre-norm block: attention over the paged KV pool, then a SwiGLU MLP, a mixture of
    SwiGLU experts, or both (the MLP as the shared expert). `mesh`: where the experts are split."""

    def __init__(self, cfg: ModelConfig, dtype, formats: dict[str, WeightFormat], mesh: Mesh | None = None):
        d, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        dense, moe = cfg.intermediate_size > 0, cfg.num_experts > 0
        self.cfg = cfg
        self.mesh = mesh
        self.input_norm = _param((d,), dtype)
        self.q_proj = _weight("layers/q_proj", cfg, dtype, formats)
        self.k_proj = _weight("layers/k_proj", cfg, dtype, formats)
        self.v_proj = _weight("layers/v_proj", cfg, dtype, formats)
        self.o_proj = _weight("layers/o_proj", cfg, dtype, formats)
        self.q_bias = _maybe(cfg.qkv_bias, (q_dim,), dtype)
        self.k_bias = _maybe(cfg.qkv_bias, (kv_dim,), dtype)
        self.v_bias = _maybe(cfg.qkv_bias, (kv_dim,), dtype)
        self.o_bias = _maybe(cfg.o_bias, (d,), dtype)
        self.q_norm = _maybe(cfg.qk_norm, (cfg.head_dim,), dtype)
        self.k_norm = _maybe(cfg.qk_norm, (cfg.head_dim,), dtype)
        self.post_attention_norm = _param((d,), dtype)   # before the MLP; Gemma: on attention's output
        self.pre_mlp_norm = _maybe(cfg.gemma, (d,), dtype)
        self.post_mlp_norm = _maybe(cfg.gemma, (d,), dtype)
        self.gate_proj = _weight("layers/gate_proj", cfg, dtype, formats) if dense else None
        self.up_proj = _weight("layers/up_proj", cfg, dtype, formats) if dense else None
        self.down_proj = _weight("layers/down_proj", cfg, dtype, formats) if dense else None
        self.gate_bias = _maybe(dense and cfg.mlp_bias, (cfg.intermediate_size,), dtype)
        self.up_bias = _maybe(dense and cfg.mlp_bias, (cfg.intermediate_size,), dtype)
        self.down_bias = _maybe(dense and cfg.mlp_bias, (d,), dtype)
        self.router = _maybe(moe, (d, cfg.num_experts), dtype)
        self.gate_experts = _expert_weight("layers/gate_experts", cfg, dtype, formats) if moe else None
        self.up_experts = _expert_weight("layers/up_experts", cfg, dtype, formats) if moe else None
        self.down_experts = _expert_weight("layers/down_experts", cfg, dtype, formats) if moe else None
        self.shared_expert_gate = _maybe(moe and dense, (d, 1), dtype)

    def __call__(self, x, kv_pages: KVPages, layer, meta: AttentionMetadata,
                 attention: AttentionBackend, adapters=None):
        """x [T, hidden] -> ([T, hidden], kv_pages with this layer's new K/V written). `adapters`:
        the LoRA slots, this layer's index, the tokens' slots and whether any token has one (or
        None; see lora.adapted)."""
        cfg = self.cfg

        def linear(x, *names):
            """The projections `names` of x (with their biases and LoRA deltas)."""
            ys = tuple(_linear(x, getattr(self, name), getattr(self, name.replace("_proj", "_bias")))
                       for name in names)
            return lora.adapted(x, adapters, names, ys)

        norm = self._norm
        h = norm(x, self.input_norm)
        q, k, v = linear(h, "q_proj", "k_proj", "v_proj")
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm(q, self.q_norm), norm(k, self.k_norm)
        q, k = self._rope(q, meta.positions, layer), self._rope(k, meta.positions, layer)
        if cfg.query_pre_attn_scalar is not None:   # the backends scale by head_dim ** -0.5
            q = q * jnp.asarray((cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5, q.dtype)
        attn, kv_pages = attention(q, k, v, kv_pages, layer, meta)
        attn, = linear(attn.reshape(attn.shape[0], -1), "o_proj")
        if cfg.gemma:
            return self._gemma_mlp(x + norm(attn, self.post_attention_norm), linear), kv_pages
        x = x + attn
        return x + self._mlp(norm(x, self.post_attention_norm), linear), kv_pages

    def _gemma_mlp(self, x, linear):
        return x + self._norm(self._mlp(self._norm(x, self.pre_mlp_norm), linear), self.post_mlp_norm)

    def _norm(self, x, weight: nnx.Param):
        return (gemma_rms_norm if self.cfg.gemma else rms_norm)(x, weight[...], self.cfg.rms_norm_eps)

    def _rope(self, x, positions, layer):
        """RoPE, with Gemma 3's windowed layers on their own base: both computed, one kept."""
        cfg = self.cfg
        rotated = apply_rope(x, positions, rope_for(cfg))
        if cfg.local_rope_theta is None:
            return rotated
        local = apply_rope(x, positions, rope_for(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta,
                                                                      rope_scaling=None)))
        return jnp.where(jnp.asarray(cfg.sliding_layers)[layer], local, rotated)

    def _mlp(self, h, linear):
        cfg, out = self.cfg, 0.0
        if cfg.intermediate_size:
            gate, up = linear(h, "gate_proj", "up_proj")
            act = jax.nn.silu if cfg.hidden_act == "silu" else functools.partial(jax.nn.gelu, approximate=True)
            out, = linear(act(gate) * up, "down_proj")
            if cfg.num_experts:   # Qwen2-MoE's shared expert, under its sigmoid gate
                out = jax.nn.sigmoid(h @ self.shared_expert_gate[...]) * out
        if cfg.num_experts:
            weights, ids = route(h, self.router[...], cfg.num_experts_per_tok, cfg.norm_topk_prob)
            out = out + experts(h, weights, ids, _stack(self.gate_experts), _stack(self.up_experts),
                                _stack(self.down_experts), self.mesh)
        return out


def _linear(x, kernel: Weight, bias: nnx.Param | None):
    y = matmul(x, kernel)
    return y if bias is None else y + bias[...]


class Llama(nnx.Module):
    """Embedding, `num_layers` stacked decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, formats: dict[str, WeightFormat] | None = None,
                 mesh: Mesh | None = None):
        formats = formats or {}
        self.cfg = cfg
        self.dtype = dtype
        self.embed = _weight("embed", cfg, dtype, formats)
        expert_mesh = mesh if cfg.num_experts else None
        self.layers = nnx.vmap(lambda: DecoderLayer(cfg, dtype, formats, expert_mesh), axis_size=cfg.num_layers)()
        self.final_norm = _param((cfg.hidden_size,), dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _weight("lm_head", cfg, dtype, formats)

    def __call__(self, token_ids, kv_pages: KVPages, meta: AttentionMetadata, logits_index,
                 attention: AttentionBackend, lora_weights=None, lora_slots=None):
        """token_ids [T] int32, logits_index [S] int32 (rows to score) -> (logits [S, vocab] f32, kv_pages)."""
        x, kv_pages = self.hidden_states(token_ids, kv_pages, meta, attention, lora_weights, lora_slots)
        return self.logits(x, logits_index), kv_pages

    def hidden_states(self, token_ids, kv_pages: KVPages, meta: AttentionMetadata, attention: AttentionBackend,
                      lora_weights=None, lora_slots=None):
        """token_ids [T] int32 -> (the last layer's output [T, hidden], kv_pages with the K/V written).
        `lora_weights` (module -> (a, b), see layers/lora.py) with `lora_slots` [T] int32: the
        tokens' LoRA adapters."""
        meta = attention.prepare(meta)   # once a step: the layers' loop would redo it in every layer
        x = embed_lookup(self.embed, token_ids, self.dtype)
        if self.cfg.gemma:   # by sqrt(hidden) in the compute dtype, as transformers rounds it
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        layer_graph, layer_weights = nnx.split(self.layers)
        any_adapted = None if lora_weights is None else jnp.any(lora_slots > 0)

        def run_layer(carry, weights_and_index):
            x, kv_pages = carry
            weights, index = weights_and_index
            adapters = None if lora_weights is None else (lora_weights, index, lora_slots, any_adapted)
            x, kv_pages = nnx.merge(layer_graph, weights)(x, kv_pages, index, meta, attention, adapters)
            return (x, kv_pages), None

        layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, kv_pages), _ = jax.lax.scan(run_layer, (x, kv_pages), (layer_weights, layer_ids))
        return x, kv_pages

    def logits(self, x, index) -> jax.Array:
        """x [T, hidden] (hidden_states), index [S] int32 -> logits [S, vocab] float32 of those rows."""
        x = (gemma_rms_norm if self.cfg.gemma else rms_norm)(x[index], self.final_norm[...], self.cfg.rms_norm_eps)
        logits = lm_head(x, self.embed, self.lm_head).astype(jnp.float32)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def abstract_model(cfg: ModelConfig, dtype, formats: dict[str, WeightFormat] | None = None,
                   mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and a state of `ShapeDtypeStruct`s to fill from a checkpoint. `mesh`:
    the one the weights will live on (experts are split over its `model` axis)."""
    if cfg.num_experts and mesh is not None and cfg.num_experts % mesh.shape["model"]:
        raise ValueError(f"num_experts={cfg.num_experts} does not split over the mesh's model axis "
                         f"({mesh.shape['model']}): use a model size that divides {cfg.num_experts}")
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype, formats, mesh)))
