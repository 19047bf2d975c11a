"""Hugging Face weight names -> jaxserve parameter paths, as one declarative table per family.

Every family we run uses Llama's names, so one table serves them all; a parameter the model does
not have (say `q_bias` on Llama) is simply never asked for. HF stores linear weights `[out, in]`;
we store `[in, out]`. Per-layer tensors are stacked on a leading layer axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

Transform = Callable[[np.ndarray], np.ndarray]


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


_LAYER = r"model\.layers\.(\d+)\."

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
    (_LAYER + r"mlp\.gate_proj\.weight", ("layers", "gate_proj"), _transpose),
    (_LAYER + r"mlp\.up_proj\.weight", ("layers", "up_proj"), _transpose),
    (_LAYER + r"mlp\.down_proj\.weight", ("layers", "down_proj"), _transpose),
    (_LAYER + r"mlp\.gate_proj\.bias", ("layers", "gate_bias"), _same),
    (_LAYER + r"mlp\.up_proj\.bias", ("layers", "up_bias"), _same),
    (_LAYER + r"mlp\.down_proj\.bias", ("layers", "down_bias"), _same),
)

# HF tensors that carry nothing we need (buffers some exports save).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def map_hf_weights(tensors: Iterable[tuple[str, np.ndarray]], expected: dict[tuple[str, ...], tuple],
                   dtype) -> dict[tuple[str, ...], np.ndarray]:
    """Arranges HF tensors into our parameter paths, as host arrays of `dtype`.

    `expected` maps each of our paths to its shape (stacked ones include the layer axis). Raises
    ValueError naming missing, unexpected or mis-shaped tensors.
    """
    table = [(re.compile(pattern + "$"), path, transform) for pattern, path, transform in LLAMA_WEIGHT_MAP]
    out: dict[tuple[str, ...], np.ndarray] = {}
    filled: dict[tuple[str, ...], set[int]] = {}
    for name, tensor in tensors:
        match = next(((m, path, t) for rx, path, t in table if (m := rx.match(name))), None)
        if match is None or match[1] not in expected:
            if _IGNORED.match(name) or (match and match[1] == ("lm_head",)):
                continue  # a tied model may still ship lm_head.weight
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        m, path, transform = match
        value = transform(np.asarray(tensor))
        shape = expected[path]
        if m.groups():
            layer = int(m.group(1))
            _check_shape(name, value.shape, shape[1:])
            if path not in out:
                out[path] = np.empty(shape, dtype)
            out[path][layer] = value
            filled.setdefault(path, set()).add(layer)
        else:
            _check_shape(name, value.shape, shape)
            out[path] = value.astype(dtype)
    _check_complete(out, filled, expected)
    return out


def _check_shape(name: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(got)}, the model expects {tuple(want)}")


def _check_complete(out, filled, expected) -> None:
    missing = ["/".join(p) for p in expected if p not in out]
    for path, layers in filled.items():
        num_layers = expected[path][0]
        if len(layers) != num_layers:
            lacking = sorted(set(range(num_layers)) - layers)
            missing.append(f"{'/'.join(path)} (layers {lacking})")
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing)}")
