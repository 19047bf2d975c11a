"""Hugging Face weight names -> jaxserve parameter paths, as one declarative table per family.

Every family we run uses Llama's names (Phi-3's fused `qkv_proj` and `gate_up_proj` are split
into them first, `split_fused`) plus the mixture-of-experts names of Mixtral and Qwen-MoE, so one
table serves them all; a parameter the model does not have (say `q_bias` on Llama) is simply
never asked for. HF stores linear weights `[out, in]`; we store `[in, out]`. Per-layer tensors
are stacked on a leading layer axis, and each expert's on a second, expert axis.

A weight with a `WeightFormat` is stored as its parts (`layers/q_proj/value`, `.../scale`, ...):
a checkpoint tensor already in that format is taken as it is, a float one is quantized, and a
quantized tensor meant to be float is dequantised.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.layers.linear import WeightFormat
from jaxserve.quantization import QuantizedTensor, quantize

Transform = Callable[[np.ndarray], np.ndarray]


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


_LAYER = r"model\.layers\.(\d+)\."
_EXPERT = r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\."

# (HF name pattern, our path, transform). A pattern with a layer group fills one slice of a stack.
LLAMA_WEIGHT_MAP: tuple[tuple[str, tuple[str, ...], Transform], ...] = (
    (r"model\.embed_tokens\.weight", ("embed",), _same),
    (r"model\.norm\.weight", ("final_norm",), _same),
    (r"lm_head\.weight", ("lm_head",), _transpose),
    (_LAYER + r"input_layernorm\.weight", ("layers", "input_norm"), _same),
    (_LAYER + r"self_attn\.q_proj\.weight", ("layers", "q_proj"), _transpose),
    (_LAYER + r"self_attn\.k_proj\.weight", ("layers", "k_proj"), _transpose),
    (_LAYER + r"self_attn\.v_proj\.weight", ("layers", "v_proj"), _transpose),
    (_LAYER + r"self_attn\.o_proj\.weight", ("layers", "o_proj"), _transpose),
    (_LAYER + r"self_attn\.q_proj\.bias", ("layers", "q_bias"), _same),
    (_LAYER + r"self_attn\.k_proj\.bias", ("layers", "k_bias"), _same),
    (_LAYER + r"self_attn\.v_proj\.bias", ("layers", "v_bias"), _same),
    (_LAYER + r"self_attn\.o_proj\.bias", ("layers", "o_bias"), _same),
    (_LAYER + r"self_attn\.q_norm\.weight", ("layers", "q_norm"), _same),
    (_LAYER + r"self_attn\.k_norm\.weight", ("layers", "k_norm"), _same),
    (_LAYER + r"post_attention_layernorm\.weight", ("layers", "post_attention_norm"), _same),
    (_LAYER + r"pre_feedforward_layernorm\.weight", ("layers", "pre_mlp_norm"), _same),     # Gemma
    (_LAYER + r"post_feedforward_layernorm\.weight", ("layers", "post_mlp_norm"), _same),
    (_LAYER + r"mlp\.gate_proj\.weight", ("layers", "gate_proj"), _transpose),
    (_LAYER + r"mlp\.up_proj\.weight", ("layers", "up_proj"), _transpose),
    (_LAYER + r"mlp\.down_proj\.weight", ("layers", "down_proj"), _transpose),
    (_LAYER + r"mlp\.gate_proj\.bias", ("layers", "gate_bias"), _same),
    (_LAYER + r"mlp\.up_proj\.bias", ("layers", "up_bias"), _same),
    (_LAYER + r"mlp\.down_proj\.bias", ("layers", "down_bias"), _same),
    # mixtures of experts: the router, each expert (Mixtral's w1/w3/w2 are gate/up/down), and
    # Qwen2-MoE's shared expert as the dense MLP with its sigmoid gate
    (_LAYER + r"(?:block_sparse_moe|mlp)\.gate\.weight", ("layers", "router"), _transpose),
    (_LAYER + _EXPERT + r"(?:w1|gate_proj)\.weight", ("layers", "gate_experts"), _transpose),
    (_LAYER + _EXPERT + r"(?:w3|up_proj)\.weight", ("layers", "up_experts"), _transpose),
    (_LAYER + _EXPERT + r"(?:w2|down_proj)\.weight", ("layers", "down_experts"), _transpose),
    (_LAYER + r"mlp\.shared_expert\.gate_proj\.weight", ("layers", "gate_proj"), _transpose),
    (_LAYER + r"mlp\.shared_expert\.up_proj\.weight", ("layers", "up_proj"), _transpose),
    (_LAYER + r"mlp\.shared_expert\.down_proj\.weight", ("layers", "down_proj"), _transpose),
    (_LAYER + r"mlp\.shared_expert_gate\.weight", ("layers", "shared_expert_gate"), _transpose),
)

# Fused HF tensors (Phi-3) -> the unfused names they stand for, in row order ([out, in]).
_FUSED = re.compile(r"(.*\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


def _fused_rows(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    q, kv, ffn = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
            "mlp.gate_up_proj": (("mlp.gate_proj", ffn), ("mlp.up_proj", ffn))}


def split_fused(tensors: Iterable[tuple[str, object]], cfg: ModelConfig) -> Iterator[tuple[str, object]]:
    """Each fused tensor as its parts (row slices, quantized ones included), named as Llama's."""
    rows_of = _fused_rows(cfg)
    for name, tensor in tensors:
        match = _FUSED.match(name)
        if match is None:
            yield name, tensor
            continue
        parts, start = rows_of[match[2]], 0
        total = sum(rows for _, rows in parts)
        if tensor.shape[0] != total:
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config's "
                             f"{' + '.join(f'{p} {r}' for p, r in parts)} make {total}")
        for part, rows in parts:
            piece = slice(start, start + rows)
            sliced = tensor.map_rows(lambda a: a[piece]) if isinstance(tensor, QuantizedTensor) else tensor[piece]
            yield f"{match[1]}{part}.weight", sliced
            start += rows


# HF tensors that carry nothing we need (buffers some exports save).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _table():
    return [(re.compile(pattern + "$"), path, transform) for pattern, path, transform in LLAMA_WEIGHT_MAP]


def _find(table, name: str):
    return next(((m, path, t) for rx, path, t in table if (m := rx.match(name))), None)


def checkpoint_formats(tensors: Iterable[tuple[str, object]]) -> dict[str, WeightFormat]:
    """Our weight path -> the format its checkpoint tensors share, for the weights whose every
    tensor (every layer's) is quantized in one format."""
    table, seen = _table(), {}
    for name, tensor in tensors:
        match = _find(table, name)
        if match is not None:
            seen.setdefault("/".join(match[1]), set()).add(getattr(tensor, "fmt", None))
    return {path: fmts.pop() for path, fmts in seen.items() if len(fmts) == 1 and None not in fmts}


def map_hf_weights(tensors: Iterable[tuple[str, np.ndarray | QuantizedTensor]], expected: dict[tuple[str, ...], tuple],
                   dtype, formats: dict[str, WeightFormat] | None = None) -> dict[tuple[str, ...], np.ndarray]:
    """Arranges HF tensors into our parameter paths, as host arrays: float ones of `dtype`, and
    the parts of every weight `formats` names (path -> format) in that format.

    `expected` maps each of our paths to its shape (stacked ones include the layer axis). Raises
    ValueError naming missing, unexpected or mis-shaped tensors.
    """
    table, formats = _table(), formats or {}
    out: dict[tuple[str, ...], np.ndarray] = {}
    filled: dict[tuple[str, ...], set[int]] = {}
    for name, tensor in tensors:
        match = _find(table, name)
        base = match and match[1]
        if match is None or not (base in expected or base + ("value",) in expected):
            if _IGNORED.match(name) or (match and base == ("lm_head",)):
                continue  # a tied model may still ship lm_head.weight
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        m, path, transform = match
        index = tuple(int(g) for g in m.groups())   # (), (layer,) or (layer, expert)
        fmt = formats.get("/".join(path))
        if isinstance(tensor, QuantizedTensor) and tensor.fmt != fmt:
            tensor = tensor.dequantized()
        if fmt is None:
            _put(out, filled, expected, name, path, index, transform(np.asarray(tensor)).astype(dtype))
            continue
        if not isinstance(tensor, QuantizedTensor):
            tensor = quantize(tensor, fmt)
        for part, value in tensor.ours(vocab_major=path in (("embed",), ("lm_head",))).items():
            _put(out, filled, expected, name, path + (part,), index, value)
    _check_complete(out, filled, expected)
    return out


def _put(out, filled, expected, name: str, path: tuple[str, ...], index: tuple[int, ...], value: np.ndarray) -> None:
    """Stores one tensor, or one slice of a stacked one: `index` is its (layer,) or (layer, expert)."""
    shape = expected[path]
    if not index:
        _check_shape(name, value.shape, shape)
        out[path] = value
        return
    _check_shape(name, value.shape, shape[len(index):])
    if any(i >= n for i, n in zip(index, shape)):
        raise ValueError(f"checkpoint tensor {name!r}: index {index} is outside the model's {shape[:len(index)]}")
    if path not in out:
        out[path] = np.empty(shape, value.dtype)
    out[path][index] = value
    filled.setdefault(path, set()).add(index)


def _check_shape(name: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")


def _check_complete(out, filled, expected) -> None:
    missing = ["/".join(p) for p in expected if p not in out]
    for path, indices in filled.items():
        stacked = expected[path][:len(next(iter(indices)))]   # (layers,) or (layers, experts)
        if len(indices) != np.prod(stacked):
            lacking = sorted(set(np.ndindex(*stacked)) - indices)
            what = "layers" if len(stacked) == 1 else "(layer, expert)"
            missing.append(f"{'/'.join(path)} ({what} {[i[0] if len(i) == 1 else i for i in lacking][:8]})")
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing)}")
