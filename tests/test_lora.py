"""LoRA adapters (PEFT) on tiny random models: logits equal to transformers + peft (and to the merged
model), batches mixing adapters equal each request alone, pages never shared across adapters,
adapters evicted and reloaded under --max-loras 1, bad adapters refused by name."""

import json

import numpy as np
import pytest

from jaxserve.checkpoint.loader import load_model
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams

from conftest import ALL_LORA_MODULES as ALL, write_adapter, write_tiny_model

CONFIG = dict(num_pages=64, page_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              enable_lora=True, max_lora_rank=8, enforce_eager=True)


def our_logits(model, adapter_dir, prompt, steps=4):
    """[steps + 1, vocab]: the prompt prefilled, then `steps` greedy decode steps, with the adapter
    in slot 1 (the tokens are transformers' own greedy ones, fed back)."""
    from jaxserve.checkpoint.peft import read_adapter
    from jaxserve.config import ModelConfig

    runner = Runner(model, 32, 8, 128, 4, 64, 16, max_loras=2, max_lora_rank=8)
    runner.load_lora(1, read_adapter(adapter_dir, ModelConfig.from_hf(model.hf_config), 8).modules)
    tokens, rows, table = list(prompt), [], tuple(range(1, 17))
    for step in range(steps + 1):
        start = 0 if step == 0 else len(tokens) - 1
        seq = ScheduledSequence("a", tuple(tokens[start:]), start, table, True, SamplingParams(temperature=0), 0, 0,
                                lora_id=7)
        logits = runner.logits(SchedulerOutput((seq,), lora_slots={"a": 1}))["a"]
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
    return np.stack(rows), tokens


@pytest.mark.parametrize("variant, targets, r, extra", [
    ("llama", ALL, 4, {}),
    ("llama", ["q_proj", "v_proj"], 8, dict(use_rslora=True)),
    ("qwen2", ["k_proj", "o_proj", "down_proj"], 2, {}),
    ("qwen3", ["gate_proj", "up_proj", "q_proj"], 4, dict(layers_to_transform=[1])),
])
def test_logits_equal_peft_and_the_merged_model(variant, targets, r, extra, tiny_models, tmp_path):
    import torch

    base_dir, _ = tiny_models(variant)
    peft_model = write_adapter(base_dir, tmp_path / "adapter", targets, r, 2 * r, **extra)
    model = load_model(str(base_dir), "float32")
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111]
    ours, tokens = our_logits(model, tmp_path / "adapter", prompt)
    with torch.no_grad():
        theirs = peft_model(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
        with peft_model.disable_adapter():
            plain = peft_model(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
        merged = peft_model.merge_and_unload()(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
    assert np.abs(theirs - plain).max() > 1e-2, "the adapter changes the logits"
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours, merged, atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_tokens, num_slots", [(1, 2), (13, 3), (40, 5)])
def test_dense_and_ragged_deltas_equal_a_loop_over_tokens(num_tokens, num_slots):
    from jaxserve.models.layers.lora import dense_delta, ragged_delta

    rng = np.random.default_rng(num_tokens)
    x = rng.normal(size=(num_tokens, 24)).astype(np.float32)
    a = rng.normal(size=(num_slots, 24, 4)).astype(np.float32)
    b = rng.normal(size=(num_slots, 4, 40)).astype(np.float32)
    a[0], b[0] = 0, 0
    slots = rng.integers(0, num_slots, num_tokens).astype(np.int32)
    expected = np.stack([x[t] @ a[slots[t]] @ b[slots[t]] for t in range(num_tokens)])
    for delta in (dense_delta, ragged_delta):   # A stored input axis first
        np.testing.assert_allclose(delta(x, a.transpose(1, 0, 2), b, slots), expected, rtol=1e-5, atol=1e-4)


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load_model(str(tiny_models("llama")[0]), "float32")


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Three adapters of the tiny Llama, on different modules and ranks."""
    base_dir, _ = tiny_models("llama")
    root = tmp_path_factory.mktemp("adapters")
    specs = [(ALL, 4), (["q_proj", "v_proj", "down_proj"], 8), (["gate_proj", "up_proj", "o_proj"], 2)]
    for i, (targets, r) in enumerate(specs):
        write_adapter(base_dir, root / f"a{i}", targets, r, 2 * r, seed=10 + i)
    return [LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")) for i in range(3)]


@pytest.fixture(scope="module")
def engine(tiny):
    return LLMEngine(EngineConfig(**CONFIG, max_loras=3), model=tiny)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(100, 140)), [3, 1, 4, 1, 5, 9, 2, 6]]


def run(engine, requests):
    """(prompt, params, lora_request) together -> each one's final output."""
    ids = [engine.add_request(prompt, params, lora_request=lora) for prompt, params, lora in requests]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.stats().kv_cache_usage == 0
    return [done[i] for i in ids]


def tokens(outputs):
    return [[o.token_ids for o in out.outputs] for out in outputs]


def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(engine, adapters):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    requests = [(p, params, lora) for p in PROMPTS[:2] for params in (greedy, seeded) for lora in (None, *adapters)]
    alone = [run(engine, [r])[0] for r in requests]
    together = run(engine, requests)
    assert tokens(together) == tokens(alone)
    for a, b in zip(together, alone):
        if a.outputs[0].logprobs:
            np.testing.assert_allclose([lp.logprob for lp in a.outputs[0].logprobs],
                                       [lp.logprob for lp in b.outputs[0].logprobs], atol=1e-5)
    by_adapter = {}
    for (_, params, lora), out in zip(requests, alone):
        if params is greedy:
            by_adapter.setdefault(lora and lora.lora_name, set()).add(tuple(out.outputs[0].token_ids))
    assert len({t for ts in by_adapter.values() for t in ts}) == len(by_adapter) * 2, "each adapter changes tokens"


def test_pages_are_never_shared_across_adapters(engine, adapters):
    prompt = list(range(300, 340))   # five 8-token pages
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run(engine, [(prompt, greedy, adapters[0])])
    hits = engine.stats().prefix_cache_hits
    (other,) = run(engine, [(prompt, greedy, adapters[1])])
    (base,) = run(engine, [(prompt, greedy, None)])
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0 and engine.stats().prefix_cache_hits == hits
    (same,) = run(engine, [(prompt, greedy, adapters[0])])
    assert same.num_cached_tokens == 32   # the first four pages (never the last prompt token)
    reloaded = LoRARequest(adapters[0].lora_name, 40, adapters[0].lora_path)   # the same name, a new identity
    (again,) = run(engine, [(prompt, greedy, reloaded)])
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == same.outputs[0].token_ids


def test_one_slot_serves_three_adapters_by_eviction_and_reload(tiny, engine, adapters):
    single = LLMEngine(EngineConfig(**CONFIG, max_loras=1, max_cpu_loras=2), model=tiny)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [(p, greedy, lora) for lora in (*adapters, None, adapters[0]) for p in PROMPTS]
    assert tokens(run(single, requests)) == tokens(run(engine, requests))
    # a1 and a2 waited while a0 ran (its later requests joined it), then took the slot in turn
    assert single.lora_adapters.num_slot_loads == 3
    again = [(PROMPTS[0], greedy, adapters[0])]   # a0 again: evicted from the slot and, with
    assert tokens(run(single, again)) == tokens(run(engine, again))   # max_cpu_loras=2, read again
    assert single.lora_adapters.num_slot_loads == 4


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(use_dora=True), "use_dora=true"),
    (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c: c.update(r=16, lora_alpha=32), "rank r=16 exceeds max_lora_rank=8"),
])
def test_adapters_we_do_not_read_are_refused_by_name(engine, adapters, tmp_path, change, message):
    import shutil

    shutil.copytree(adapters[0].lora_path, tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "adapter_config.json").read_text())
    change(config)
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match=message) as error:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), lora_request=LoRARequest("bad", 90, str(tmp_path / "bad")))
    assert error.value.param == "lora_path" and "bad" in str(error.value)


def test_an_adapter_of_another_model_names_the_module(engine, adapters, tmp_path, smollm2_tokenizer):
    write_tiny_model(tmp_path / "wide", "llama", smollm2_tokenizer, hidden_size=96)
    write_adapter(tmp_path / "wide", tmp_path / "adapter", ["q_proj"])
    with pytest.raises(InvalidRequestError, match=r"q_proj: lora_A \(4, 96\) and lora_B \(96, 4\) do not fit"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), lora_request=LoRARequest("w", 91, str(tmp_path / "adapter")))
    engine.add_lora(adapters[0])
    with pytest.raises(InvalidRequestError, match="is already adapter 'a0'"):
        engine.add_lora(LoRARequest("other", 1, str(tmp_path / "adapter")))


def test_an_engine_without_lora_refuses_an_adapter(tiny, adapters):
    plain = LLMEngine(EngineConfig(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                                   max_model_len=128), model=tiny)
    with pytest.raises(InvalidRequestError, match="start it with --enable-lora"):
        plain.add_request([1, 2], SamplingParams(max_tokens=2), lora_request=adapters[0])
