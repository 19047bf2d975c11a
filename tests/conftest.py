"""Shared fixtures: a persistent compile cache, tiny random HF checkpoints, the embedded SmolLM2."""

from __future__ import annotations

import gc
import os
import pathlib

import jax
import pytest

from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.loader import load_model
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.tokenizer import load_tokenizer

# The workloads ship in the shared folder beside the checkout (as CI lays it out too); a checkout
# elsewhere names them with $JAXSERVE_WORKLOADS.
WORKLOADS = pathlib.Path(os.environ.get("JAXSERVE_WORKLOADS")
                         or pathlib.Path(__file__).resolve().parents[2] / "shared" / "workloads")

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.1)

# name -> (transformers config class, model class, config overrides)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "smollm2_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12)),   # < the tests' contexts
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    # the window (< the tests' contexts) on the second layer only: transformers' layer_types from max_window_layers
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=12,
                                                             max_window_layers=1)),
    # LongRoPE past position 64 (the tests decode across it), 12 of 16 head dims rotated
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
        short_factor=[1.0, 1.05, 1.1, 1.2, 1.3, 1.5], long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0]))),
    # mixtures of experts: Mixtral top-2 of 4 (renormalised), Qwen3-MoE top-3 of 8 (norm_topk_prob),
    # Qwen2-MoE top-2 of 4 unnormalised beside a gated shared expert
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3,
                                                                moe_intermediate_size=32, norm_topk_prob=True)),
    # Qwen3-MoE windows every layer once use_sliding_window is on (it reads no layer_types)
    "qwen3_moe_window": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        use_sliding_window=True, sliding_window=12)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=48)),
    # Gemma: windowed and full layers alternating (2) or 2 of 3 windowed (3), windows shorter than
    # the tests' contexts; Gemma 2 soft-caps scores and logits (caps low enough to bite), Gemma 3
    # gives windowed layers their own RoPE base and full ones linear scaling
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})),
}


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """Engines built twice with the same shapes compile once."""
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax-cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
    """Drops each module's compiled programs when it ends: one process runs every module."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return load_tokenizer(default_model_path())


def write_tiny_model(directory: pathlib.Path, variant: str, tokenizer, **overrides):
    """Saves a random-weight HF checkpoint (safetensors + config + tokenizer); returns the torch model."""
    import torch
    import transformers

    config_name, model_name, variant_overrides = VARIANTS[variant]
    config = getattr(transformers, config_name)(**{**TINY, **variant_overrides, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm2_tokenizer):
    """variant -> (checkpoint dir, torch model), built on first use."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            directory = tmp_path_factory.mktemp(variant)
            cache[variant] = (directory, write_tiny_model(directory, variant, smollm2_tokenizer))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, loaded once: float32 compute over its own Q4_1 / Q8_0
    weights (`--quantization auto`)."""
    return load_model(None, "float32")


ALL_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base_dir, out_dir, targets=ALL_LORA_MODULES, r=4, alpha=8, seed=1, **extra):
    """A random PEFT adapter (init_lora_weights=False: B is not zero) and the PeftModel it came from."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                            **extra)).eval()
    with torch.no_grad():   # peft's random init is small: make each adapter move the logits clearly
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(out_dir)
    return model


def recorded_slots(monkeypatch) -> list[tuple[str, tuple[int, bool, bool]]]:
    """Each penalised row's (id, (slot, filled, counted)) as the runners' PenaltySlots give them."""
    given = []
    slot_for = PenaltySlots.slot_for

    def recording(self, row):
        given.append((row.request_id, slot_for(self, row)))
        return given[-1][1]
    monkeypatch.setattr(PenaltySlots, "slot_for", recording)
    return given
