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
    return LLMEngine(EngineConfig(max_model_len=1024, num_pages=400, max_num_seqs=16,
                                  max_num_batched_tokens=256), model=smollm2)


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


@pytest.mark.slow
def test_greedy_tokens_match_transformers_on_the_gguf(engine):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.checkpoint.default_model import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
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
