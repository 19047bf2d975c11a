"""Which Hugging Face architectures jaxserve runs, and the per-family switches of the Llama decoder."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    qkv_bias: bool = False  # bias on q/k/v projections even without `attention_bias` (Qwen2)
    qk_norm: bool = False   # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: bool = False  # every layer attends within config.sliding_window (Mistral, Phi-3)
    moe: bool = False       # a mixture of experts in every layer's MLP (see models/layers/moe.py)
    gemma: bool = False     # Gemma 2 / 3's norms, scaled embeddings, GeGLU, per-layer windows (config.py)
    # Qwen: with `use_sliding_window`, the windowed layers are those `layer_types` names, or without
    # it: "from_max" (from `max_window_layers` on), "even_below_max" (the even ones below it);
    # "all": every layer, `layer_types` unread (config._qwen_window_layers)
    qwen_windows: str = ""


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),          # Llama 2/3, SmolLM2
    "MistralForCausalLM": Family(sliding_window=True),
    "Qwen2ForCausalLM": Family(qkv_bias=True, qwen_windows="from_max"),
    "Qwen3ForCausalLM": Family(qk_norm=True, qwen_windows="from_max"),
    "Phi3ForCausalLM": Family(sliding_window=True),           # fused qkv / gate_up split at load; LongRoPE, partial rotary
    "MixtralForCausalLM": Family(sliding_window=True, moe=True),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, moe=True, qwen_windows="even_below_max"),  # + gated shared expert
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe=True, qwen_windows="all"),
    "Gemma2ForCausalLM": Family(gemma=True),   # attention and final logit soft-capping
    "Gemma3ForCausalLM": Family(qk_norm=True, gemma=True),   # text only; RoPE per layer type
}


def family_of(architecture: str) -> Family:
    """The family switches for an HF `architectures` name; unknown names list the supported ones."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        ) from None
