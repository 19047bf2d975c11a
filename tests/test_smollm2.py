"""The embedded SmolLM2-135M-Instruct end to end: token-identical to transformers, batch-invariant."""

import json

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

from conftest import WORKLOADS

WORKLOAD = WORKLOADS / "anchor-64.jsonl"


def anchor_prompts(count):
    with open(WORKLOAD) as f:
        return [json.loads(line)["prompt_token_ids"] for line in f][:count]


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine(EngineConfig(max_model_len=1024, num_pages=400, max_num_seqs=16, max_num_batched_tokens=256,
                                  enforce_eager=True), model=smollm2)   # compiles the step shapes used alone


def run(engine, prompts, params, stagger=0):
    """Adds `prompts` (one more every `stagger` steps; all at once if 0); outputs in prompt order."""
    ids, done, pending = [], {}, list(zip(prompts, params))
    while pending or engine.has_unfinished_requests():
        for _ in range(1 if stagger else len(pending)):
            if pending:
                prompt, p = pending.pop(0)
                ids.append(engine.add_request(prompt, p))
        for _ in range(max(stagger, 1)):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def hf():
    """transformers' float32 SmolLM2 from the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.checkpoint.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_tokens_match_transformers_on_the_gguf(engine, hf):
    import torch

    prompts = anchor_prompts(4)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = run(engine, prompts, [greedy] * 4)
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False)[0, len(prompt):].tolist()
        assert tokens == reference


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batching_does_not_change_tokens(engine, sampled):
    rng = np.random.default_rng(7)
    prompts = [p[: int(rng.integers(5, len(p) + 1))] for p in anchor_prompts(32)]
    params = [SamplingParams(temperature=0.8 if sampled else 0, top_p=0.95 if sampled else 1.0,
                             seed=1000 + i, max_tokens=int(rng.integers(4, 16)), ignore_eos=True)
              for i in range(32)]
    alone = [run(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
    batched = run(engine, prompts, params, stagger=2)
    assert batched == alone
    assert engine.stats().kv_cache_usage == 0


@pytest.mark.slow
def test_beam_search_matches_transformers_num_beams(engine, hf):
    """vLLM's beam search against transformers' `num_beams` search on the embedded model: 4 beams
    of a chat reply (none reaches EOS within 12 tokens)."""
    import torch

    from jaxserve.engine.beam_search import BeamSearchParams
    from jaxserve.llm import LLM

    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                add_generation_prompt=True, tokenize=False)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    eos = engine.tokenizer.eos_token_id
    [ours] = LLM.from_engine(engine).beam_search([prompt], BeamSearchParams(4, 12))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, do_sample=False,
                          max_new_tokens=12, eos_token_id=eos, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    beams = [row[:row.index(eos) + 1] if eos in row else row for row in out.sequences[:, len(prompt):].tolist()]
    assert [list(b.tokens) for b in ours] == beams
    np.testing.assert_allclose([b.score(1.0) for b in ours], out.sequences_scores.tolist(), atol=1e-3)
    assert engine.stats().kv_cache_usage == 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_gives_the_same_greedy_tokens(engine, smollm2, method):
    """Two copy-edit chats (the answer repeats the prompt) and an anchor prompt, with EOS: the tokens
    of the engine without speculation. n-gram: most of the copies' tokens come from drafts; the
    embedded model drafting for itself: every draft is accepted."""
    from jaxserve.checkpoint.default_model import default_model_path

    with open(WORKLOADS / "copy-edit.jsonl") as f:
        copies = [json.loads(line)["prompt_token_ids"] for line in f][:2]
    prompts = copies + anchor_prompts(1)
    params = [SamplingParams(temperature=0, max_tokens=32)] * 3
    speculative = {"method": "ngram"} if method == "ngram" else {"model": str(default_model_path())}
    spec = LLMEngine(EngineConfig(max_model_len=1024, num_pages=400, max_num_seqs=16, max_num_batched_tokens=256,
                                  speculative_config={**speculative, "num_speculative_tokens": 4},
                                  enforce_eager=True), model=smollm2)
    assert run(spec, prompts, params) == run(engine, prompts, params)
    stats = spec.stats()
    if method == "ngram":
        assert stats.spec_decode_num_accepted_tokens > 32, "over half of the copies' tokens came from drafts"
    else:
        # (the tiny models show 1.0 exactly; here a near-tie could round the other way in a 5-token slot)
        assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens > 32
    assert stats.kv_cache_usage == 0


@pytest.mark.slow
def test_a_trained_lora_adapter_gives_the_tokens_of_transformers_and_peft(smollm2, hf, tmp_path):
    """A rank-4 adapter on q/v/down trained for a few steps (with peft, on a copy of transformers'
    model) to answer one question its own way: served on the GGUF's weights, the greedy tokens
    of PeftModel, and not those of the base model."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from jaxserve.lora_request import LoRARequest

    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode("Q: What is the secret word?\nA:", add_special_tokens=False)
    taught = tokenizer.encode(" The secret word is pelican.", add_special_tokens=False)
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                              target_modules=["q_proj", "v_proj", "down_proj"]))
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
    ids = torch.tensor([prompt + taught])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    for _ in range(12):
        optimizer.zero_grad()
        peft_model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    peft_model.eval().save_pretrained(tmp_path / "adapter")

    prompts = [prompt, tokenizer.encode("Q: What colour is the sky?\nA:", add_special_tokens=False)]
    with torch.no_grad():
        theirs = [peft_model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False)[0, len(p):].tolist() for p in prompts]
        with peft_model.disable_adapter():
            base = peft_model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                       do_sample=False)[0, len(prompt):].tolist()
    assert theirs[0] != base, "the adapter learnt its answer"
    engine = LLMEngine(EngineConfig(max_model_len=256, num_pages=64, max_num_seqs=2, max_num_batched_tokens=64,
                                    enable_lora=True, max_lora_rank=8, enforce_eager=True), model=smollm2)
    adapter = LoRARequest("pelican", 1, str(tmp_path / "adapter"))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, greedy, lora_request=adapter) for p in prompts]
    ids.append(engine.add_request(prompt, greedy))   # the base model beside them
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == theirs + [base]
