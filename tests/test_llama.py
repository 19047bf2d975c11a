"""Logits parity with Hugging Face transformers for every supported family, through the paged path."""

import jax
import numpy as np
import pytest
import torch

from jaxserve.checkpoint.loader import load_model
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.engine.step import compile_forward
from jaxserve.models.layers.attention import backend_for
from jaxserve.sampling_params import SamplingParams

from conftest import TINY as TINY_CONFIG, VARIANTS

PAGE_SIZE = 4
PROMPT_LEN = 37
DECODE_STEPS = 16


def _sequence(tokens, start, table, samples=True):
    return ScheduledSequence("s", tuple(tokens), start, tuple(table), samples, SamplingParams(temperature=0), 0, 0)


def _paged_logits(model, prompt, continuation):
    """Prefill logits at every prompt position, then one logit row per decode step."""
    runner = Runner(model, pages_per_slice=64, page_size=PAGE_SIZE, max_model_len=128, max_num_seqs=4,
                    max_num_batched_tokens=64, prefill_segment=16, kv_chunk_tokens=8)
    rng = np.random.default_rng(0)
    total = len(prompt) + len(continuation)
    table = rng.permutation(np.arange(1, 64))[: -(-total // PAGE_SIZE)].tolist()  # scattered pages
    output = SchedulerOutput((_sequence(prompt, 0, table),))
    batch, _ = runner.layout.build(output, runner.bucket_for(output))
    gd = runner.bucket_for(output).num_decode
    batch = batch.replace(logits_index=np.arange(gd, gd + len(prompt), dtype=np.int32))
    forward = compile_forward(model.graphdef, backend_for(model.config, "xla", runner.layout.pages_per_chunk))
    prefill, runner.kv_pages = forward(model.params, runner.kv_pages, None, batch)
    decoded = []
    for i, token in enumerate(continuation):
        step = SchedulerOutput((_sequence([token], len(prompt) + i, table),))
        decoded.append(runner.logits(step)["s"])
    return np.asarray(prefill), np.stack(decoded)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tiny_models):
    directory, hf_model = tiny_models(variant)
    model = load_model(str(directory), "float32")
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, PROMPT_LEN).tolist()
    with torch.no_grad():
        generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                      min_new_tokens=DECODE_STEPS)[0].tolist()
        reference = hf_model(torch.tensor([generated])).logits[0].numpy()
    continuation = generated[PROMPT_LEN:]
    prefill, decoded = _paged_logits(model, prompt, continuation)
    np.testing.assert_allclose(prefill, reference[:PROMPT_LEN], atol=1e-4, rtol=0)
    np.testing.assert_allclose(decoded, reference[PROMPT_LEN:PROMPT_LEN + DECODE_STEPS], atol=1e-4, rtol=0)


def test_phi3_longrope_switches_to_the_long_factors_past_the_original_context(tiny_models):
    """Decoding across position 64 one token at a time through transformers' cache: the short
    factors up to 63, the long ones from 64, each token by its own position. (transformers'
    `generate` instead drops its cache at the crossing and recomputes every position with the
    long factors; see jaxserve.models.layers.rope.)"""
    directory, hf_model = tiny_models("phi3")
    model = load_model(str(directory), "float32")
    assert model.config.rotary_dim == 12 and model.config.rope_scaling.kind == "longrope"
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, model.config.vocab_size, 60).tolist()
    continuation = rng.integers(0, model.config.vocab_size, 8).tolist()
    with torch.no_grad():
        step = hf_model(torch.tensor([prompt]), use_cache=True)
        reference = [step.logits[0, -1]]
        for token in continuation:
            step = hf_model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
            reference.append(step.logits[0, -1])
    reference = torch.stack(reference).numpy()    # positions 59 (the prompt's last), 60, ..., 67
    prefill, decoded = _paged_logits(model, prompt, continuation)
    np.testing.assert_allclose(prefill[-1], reference[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(decoded, reference[1:], atol=1e-4, rtol=0)


def test_variants_read_their_family_switches(tiny_models):
    assert load_model(str(tiny_models("qwen2")[0]), "float32").config.qkv_bias
    qwen3 = load_model(str(tiny_models("qwen3")[0]), "float32").config
    assert qwen3.qk_norm and qwen3.head_dim == 24
    assert load_model(str(tiny_models("smollm2_tied")[0]), "float32").config.tie_word_embeddings
    assert load_model(str(tiny_models("llama3_rope")[0]), "float32").config.rope_scaling.factor == 8.0
    windowed = load_model(str(tiny_models("mistral_window")[0]), "float32")
    # the window is applied, so the context is the model's whole one, not capped at the window
    assert (windowed.config.sliding_window, windowed.config.max_position_embeddings) == (12, 512)
    qwen_window = load_model(str(tiny_models("qwen2_window")[0]), "float32").config
    assert (qwen_window.sliding_window, qwen_window.sliding_layers, qwen_window.max_position_embeddings) == (
        12, (False, True), 512)
    # a window that use_sliding_window leaves off (Qwen2.5's configs) is not applied
    assert load_model(str(tiny_models("qwen2")[0]), "float32").config.sliding_window is None


def test_qwen_windows_the_layers_its_config_names():
    """Qwen windows only with use_sliding_window: the layers in layer_types, or without them
    (configs written before transformers 5) by each family's rule."""
    from jaxserve.config import ModelConfig

    base = dict(TINY_CONFIG, architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, sliding_window=12,
                max_window_layers=1, use_sliding_window=True)

    def read(**changes):
        config = ModelConfig.from_hf({**base, **changes})
        return config.sliding_window, config.sliding_layers, config.max_position_embeddings

    assert read() == (12, (False, True, True, True), 512)
    assert read(layer_types=["sliding_attention"] * 3 + ["full_attention"]) == (12, (True, True, True, False), 512)
    assert read(max_window_layers=0) == (12, (), 512)          # every layer: pages may be released
    assert read(max_window_layers=4) == (None, (), 512)
    assert read(use_sliding_window=False) == (None, (), 512)
    # the MoE families without layer_types, as transformers 5 reads them: Qwen3-MoE windows every
    # layer (layer_types or not), Qwen2-MoE the even layers below max_window_layers
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert read(architectures=["Qwen3MoeForCausalLM"], **moe) == (12, (), 512)
    assert read(architectures=["Qwen3MoeForCausalLM"], layer_types=["full_attention"] * 4, **moe) == (12, (), 512)
    assert read(architectures=["Qwen2MoeForCausalLM"], max_window_layers=3, **moe) == (
        12, (True, False, True, False), 512)
    assert read(architectures=["Qwen2MoeForCausalLM"], max_window_layers=0, **moe) == (None, (), 512)


def test_gemma_reads_its_switches(tiny_models):
    gemma2 = load_model(str(tiny_models("gemma2")[0]), "float32").config
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (2.0, 3.0)
    assert gemma2.sliding_layers == (True, False) and gemma2.hidden_act == "gelu_tanh" and gemma2.gemma
    gemma3 = load_model(str(tiny_models("gemma3")[0]), "float32").config
    assert gemma3.sliding_layers == (True, True, False) and gemma3.qk_norm and gemma3.query_pre_attn_scalar == 24
    assert (gemma3.local_rope_theta, gemma3.rope_theta, gemma3.rope_scaling.kind) == (10000.0, 1e6, "linear")
    assert gemma3.max_position_embeddings > gemma3.sliding_window   # windows applied, context not capped
    # transformers 4's configs, before `layer_types`: Gemma 2 alternates, Gemma 3 has every 6th full
    from jaxserve.config import ModelConfig

    old = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
               head_dim=16, sliding_window=8, rope_theta=1e6)
    assert ModelConfig.from_hf({**old, "architectures": ["Gemma2ForCausalLM"]}).sliding_layers == (True, False) * 3
    old3 = ModelConfig.from_hf({**old, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 6,
                                "rope_local_base_freq": 10000.0})
    assert old3.sliding_layers == (True,) * 5 + (False,) and old3.local_rope_theta == 10000.0
    pallas = backend_for(gemma2, "pallas", 2)   # each layer's window picked in the layer scan
    assert (pallas.layer_windows, pallas.softcap) == ((gemma2.sliding_window, 0), 2.0)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, smollm2_tokenizer):
    """A Gemma3ForConditionalGeneration directory (a tiny SigLIP tower beside the tiny Gemma 3) is
    read as its language model: config.json's text part holds only what differs from
    transformers' defaults, the tensors sit under the multimodal prefixes, the vision ones are
    skipped. Our logits on text equal the multimodal model's."""
    import json

    import transformers

    from conftest import TINY

    text = transformers.Gemma3TextConfig(**{**TINY, **VARIANTS["gemma3"][2]})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    hf_model.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())   # as the Hub's: defaults left out
    given = {**TINY, **VARIANTS["gemma3"][2]}
    saved["text_config"] = {"model_type": "gemma3_text",
                            **{k: v for k, v in saved["text_config"].items() if k in given}}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    model = load_model(str(tmp_path), "float32")
    assert model.config.architecture == "Gemma3ForCausalLM" and model.config.sliding_layers == (True, True, False)
    tokens = np.random.default_rng(2).integers(0, TINY["vocab_size"], PROMPT_LEN + 4).tolist()
    with torch.no_grad():
        reference = hf_model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    prefill, decoded = _paged_logits(model, tokens[:PROMPT_LEN], tokens[PROMPT_LEN:])
    np.testing.assert_allclose(np.concatenate([prefill, decoded]), reference, atol=1e-4, rtol=0)


def test_the_sliding_window_changes_what_a_query_sees(tiny_models):
    """The same weights with the window off differ past the window and agree within it."""
    import dataclasses

    windowed = load_model(str(tiny_models("mistral_window")[0]), "float32")
    full = dataclasses.replace(windowed, config=dataclasses.replace(windowed.config, sliding_window=None))
    prompt = list(range(3, 40))
    a, b = _paged_logits(windowed, prompt, [5])[0], _paged_logits(full, prompt, [5])[0]
    np.testing.assert_allclose(a[:12], b[:12], atol=1e-5, rtol=0)
    assert np.abs(a[12:] - b[12:]).max() > 1e-2


def test_float16_logits_match_transformers_in_float16(tiny_models):
    """`--dtype float16` end to end on CPU: weights, activations and KV pages in float16."""
    import copy

    directory, hf_model = tiny_models("llama")
    model = load_model(str(directory), "float16")
    assert {leaf.dtype.name for leaf in jax.tree.leaves(model.params)} == {"float16"}
    prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, PROMPT_LEN).tolist()
    half = copy.deepcopy(hf_model).half()
    with torch.no_grad():
        generated = half.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, min_new_tokens=4)
        reference = half(generated).logits[0].float().numpy()
    prefill, decoded = _paged_logits(model, prompt, generated[0, PROMPT_LEN:].tolist())
    assert prefill.dtype == np.float32   # the sampler's logits are float32 whatever the compute dtype
    np.testing.assert_allclose(prefill, reference[:PROMPT_LEN], atol=3e-2, rtol=0)
    np.testing.assert_allclose(decoded, reference[PROMPT_LEN:PROMPT_LEN + 4], atol=3e-2, rtol=0)
