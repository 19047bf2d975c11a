"""Beam search against transformers' `num_beams` search on the same checkpoint."""

import numpy as np
import pytest
import torch

from jaxserve.config import EngineConfig
from jaxserve.engine.beam_search import BeamSearchParams
from jaxserve.engine.engine import LLMEngine
from jaxserve.llm import LLM

PROMPT_LEN, MAX_TOKENS, WIDTH = 12, 8, 4


@pytest.fixture(scope="module")
def llm(tiny_models):
    directory, _ = tiny_models("llama")
    return LLM.from_engine(LLMEngine(EngineConfig(model=str(directory), num_pages=256, page_size=8, max_num_seqs=8,
                                                  max_num_batched_tokens=128, max_model_len=128)))


def hf_beams(hf_model, prompt, eos, **options):
    """transformers' beams (generated tokens, up to and with EOS) and scores, best first."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
                                max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=0,
                                output_scores=True, return_dict_in_generate=True, **options)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        beams.append(row[:row.index(eos) + 1] if eos is not None and eos in row else row)
    return beams, out.sequences_scores.tolist()


def prompt_of(llm, seed):
    return np.random.default_rng(seed).integers(0, llm.engine.model.config.vocab_size, PROMPT_LEN).tolist()


def test_beams_match_transformers_without_eos(llm, tiny_models):
    _, hf_model = tiny_models("llama")
    prompt = prompt_of(llm, 1)
    [ours] = llm.beam_search([prompt], BeamSearchParams(WIDTH, MAX_TOKENS, ignore_eos=True))
    beams, scores = hf_beams(hf_model, prompt, None)
    assert [list(b.tokens) for b in ours] == beams
    np.testing.assert_allclose([b.score(1.0) for b in ours], scores, atol=1e-4)
    assert llm.engine.stats().kv_cache_usage == 0


@pytest.mark.parametrize("early_stopping, length_penalty", [(True, 1.0), (False, 1.0), (False, 2.0), ("never", 0.5)])
def test_beams_match_transformers_with_eos(llm, tiny_models, monkeypatch, early_stopping, length_penalty):
    """EOS is made a token the search meets (the third of transformers' greedy reply), so beams finish
    at different lengths and the length penalty and early stopping decide."""
    _, hf_model = tiny_models("llama")
    prompt = prompt_of(llm, 2)
    with torch.no_grad():
        greedy = hf_model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    eos = greedy[2]
    monkeypatch.setattr(llm.engine, "eos_token_ids", (eos,))
    params = BeamSearchParams(WIDTH, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping)
    [ours] = llm.beam_search([prompt], params)
    beams, scores = hf_beams(hf_model, prompt, eos, early_stopping=early_stopping, length_penalty=length_penalty)
    assert [list(b.tokens) for b in ours] == beams
    np.testing.assert_allclose([b.score(length_penalty) for b in ours], scores, atol=1e-4)
    assert [b.finished for b in ours] == [b[-1] == eos for b in beams]
    if length_penalty == 1.0:   # these searches end on EOS beams; a larger penalty favours long ones
        assert ours[0].finished


def test_bad_beam_search_params_are_refused():
    with pytest.raises(ValueError, match=r"beam_width=11 must be in \[1, 10\]"):
        BeamSearchParams(11, 8)
    with pytest.raises(ValueError, match="early_stopping='sometimes' is not one of"):
        BeamSearchParams(2, 8, early_stopping="sometimes")
