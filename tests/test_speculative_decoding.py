"""Speculative decoding (n-gram and draft models) through the engine on tiny random models: the
tokens, logprobs, texts and finish reasons of the engine without speculation, several tokens a
step, every page back."""

import numpy as np
import pytest

from jaxserve.checkpoint.loader import load_model
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.engine.request import Request
from jaxserve.engine.sampler import PROMPT_TOKEN
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

from conftest import recorded_slots

CONFIG = dict(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              enforce_eager=True)   # each step shape compiled when first needed: the tests take few
NGRAM = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
COPY = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 3 + [10, 11]   # a prompt to copy from
PROMPTS = [COPY, [3, 4, 5], list(range(100, 140)), [7, 8, 7, 8, 7]]
FOX = "the quick brown fox jumps over the lazy dog"   # a choice to write under structured outputs


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load_model(str(tiny_models("llama")[0]), "float32")


@pytest.fixture(scope="module")
def plain(tiny):
    return LLMEngine(EngineConfig(**CONFIG), model=tiny)


@pytest.fixture(scope="module")
def spec(tiny):
    return LLMEngine(EngineConfig(**CONFIG, speculative_config=NGRAM), model=tiny)


def run(engine, requests):
    """Runs (prompt, params) requests together: each one's final output and the token counts its
    stream showed, step by step."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final, streamed = {}, {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id].append([len(o.token_ids) for o in out.outputs])
            if out.finished:
                final[out.request_id] = out
    assert engine.stats().kv_cache_usage == 0   # every page back in the pool
    return [final[i] for i in ids], [streamed[i] for i in ids]


def samples(outputs):
    return [[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outputs]


def drafted(engine):
    stats = engine.stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def test_greedy_tokens_equal_the_engine_without_speculation(plain, spec):
    requests = [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    before = drafted(spec)
    expected, _ = run(plain, requests)
    got, streamed = run(spec, requests)
    assert samples(got) == samples(expected)
    proposed, accepted = np.subtract(drafted(spec), before)
    assert 0 < accepted < proposed                    # drafts both kept and rejected
    steps = [len(s) for s in streamed]
    assert sum(steps) < 4 * 40                        # fewer steps than tokens: several tokens a step
    assert all(b[0] > a[0] for s in streamed for a, b in zip(s, s[1:]))


def test_seeded_sampling_penalties_and_bias_equal_the_engine_without_speculation(plain, spec):
    """Each sample keeps its seed's index, and a penalised draft row counts the drafts before it.
    The bias makes the random model repeat three tokens, so that sampled drafts are kept at times."""
    bias = {10: 6.0, 11: 6.0, 12: 6.0}
    variants = [dict(temperature=1.0, top_p=0.9, top_k=20, seed=2), dict(temperature=1.0, seed=5, min_p=0.1),
                dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4),
                dict(temperature=0.5, seed=3, presence_penalty=0.5), dict(temperature=0.7, seed=4, n=2)]
    requests = [(COPY, SamplingParams(max_tokens=30, ignore_eos=True, logit_bias=bias, **v)) for v in variants]
    before = drafted(spec)
    expected, _ = run(plain, requests)
    assert samples(run(spec, requests)[0]) == samples(expected)
    assert samples(run(spec, requests)[0]) == samples(expected)   # and again: reproducible
    assert drafted(spec)[1] > before[1]


def test_logprobs_of_accepted_tokens_equal_those_without_speculation(plain, spec):
    requests = [(COPY, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3))]
    (expected,), _ = run(plain, requests)
    (got,), _ = run(spec, requests)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    for a, b in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_constrained_samples_speculate_within_their_grammar(plain, spec):
    """Proposals are cut to what a sample's grammar allows, and each draft row is sampled under the
    mask after the drafts before it: the engine's tokens without speculation, drafts kept. A grammar
    complete at an accepted draft (EOS, copied from the prompt) ends the sample there, and the token
    the run has after it is dropped, as a step without drafts would never have sampled it."""
    ids = plain.tokenizer.encode(FOX, add_special_tokens=False)
    eos = plain.eos_token_ids[0]
    choice = StructuredOutputsParams(choice=[FOX])
    bias = {t: 8.0 for t in ids}   # the prompt's way of writing the text, so that its n-grams recur
    requests = [(ids + [eos], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=bias,
                                             structured_outputs=choice)),
                (ids + [eos], SamplingParams(temperature=0.8, seed=1, max_tokens=40, logit_bias=bias,
                                             structured_outputs=choice))]
    before = drafted(spec)
    expected, _ = run(plain, requests)
    got, streamed = run(spec, requests)
    assert samples(got) == samples(expected)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in got] == [(ids, FOX)] * 2
    accepted = drafted(spec)[1] - before[1]
    assert accepted > len(ids) and max(len(s) for s in streamed) < len(ids)   # several tokens a step


def test_stops_inside_an_accepted_run_send_nothing_past_them(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (reference,), _ = run(plain, [(COPY, greedy)])
    tokens, text = reference.outputs[0].token_ids, reference.outputs[0].text
    stop_id = tokens[9]
    stop_text = text[len(text) // 2:][:4]
    requests = [(COPY, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id])),
                (COPY, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_text])),
                (COPY, SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))]
    expected, _ = run(plain, requests)
    got, streamed = run(spec, requests)
    assert samples(got) == samples(expected)
    assert got[0].outputs[0].token_ids[-1] == stop_id and got[0].outputs[0].finish_reason == "stop"
    assert stop_text not in got[1].outputs[0].text and got[1].outputs[0].finish_reason == "stop"
    assert len(got[2].outputs[0].token_ids) == 13 and max(s[0] for s in streamed[2]) == 13


def test_preemption_prefix_caching_and_priorities_keep_the_tokens(tiny, plain):
    """A small pool: drafts take only free pages, preempted requests recompute, and a repeated
    prompt is found in the cache; the tokens are those of the large pool without speculation."""
    small = LLMEngine(EngineConfig(**{**CONFIG, "num_pages": 24}, scheduling_policy="priority",
                                   speculative_config=NGRAM), model=tiny)
    requests = [(COPY[i:] + [i], SamplingParams(temperature=0, max_tokens=40 + i, ignore_eos=True))
                for i in range(6)] + [(COPY, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))] * 2
    expected, _ = run(plain, requests)
    got, _ = run(small, requests)
    assert samples(got) == samples(expected)
    stats = small.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_a_one_token_prompt_speculates_from_its_first_step(plain, spec, self_drafting):
    requests = [([5], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    expected, _ = run(plain, requests)
    before = drafted(self_drafting)
    assert samples(run(spec, requests)[0]) == samples(expected)
    assert samples(run(self_drafting, requests)[0]) == samples(expected)
    assert drafted(self_drafting)[1] > before[1]


def test_decodes_speculate_beside_a_chunked_prompt(plain, spec, monkeypatch):
    steps = []
    launch = spec.runner.launch

    def recording(output, *rest):
        steps.append((any(not q.draft_token_ids and q.num_tokens > 1 for q in output.sequences),
                      any(q.draft_token_ids for q in output.sequences)))
        return launch(output, *rest)

    monkeypatch.setattr(spec.runner, "launch", recording)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [(COPY, greedy), (list(range(200, 300)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    expected, _ = run(plain, requests)
    ids = [spec.add_request(*requests[0])]
    for _ in range(22):                            # into the copy's repetitions
        spec.step()
    ids.append(spec.add_request(*requests[1]))    # 100 prompt tokens: chunks over 2 steps of 64
    final = {}
    while spec.has_unfinished_requests():
        final.update({o.request_id: o for o in spec.step() if o.finished})
    assert samples([final[i] for i in ids]) == samples(expected)
    assert (True, True) in steps, "a prompt chunk and drafts in one step"
    assert spec.stats().kv_cache_usage == 0


def test_no_drafts_above_the_batch_size_cut_off(tiny):
    engine = LLMEngine(EngineConfig(**CONFIG, speculative_config={**NGRAM, "disable_by_batch_size": 1}), model=tiny)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    run(engine, [(COPY, greedy), (COPY[1:], greedy)])
    assert drafted(engine) == (0, 0)
    run(engine, [(COPY, greedy)])
    assert drafted(engine)[0] > 0


def test_counters_move_by_the_drafts_kept(spec):
    """Each step that sends k tokens of a request with drafts accepted k - 1 of them."""
    before = spec.stats()
    (out,), (streamed,) = run(spec, [(COPY, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))])
    after = spec.stats()
    counts = [0] + [s[0] for s in streamed]
    sent = np.diff(counts)[1:]   # the first step sends the prompt's sample
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert accepted == sum(sent - 1) > 0
    per_position = np.subtract(after.spec_decode_num_accepted_tokens_per_pos,
                               np.pad(before.spec_decode_num_accepted_tokens_per_pos,
                                      (0, 4 - len(before.spec_decode_num_accepted_tokens_per_pos))))
    assert per_position.sum() == accepted and all(np.diff(per_position) <= 0)
    assert per_position[0] == sum(sent > 1)
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    assert sum(sent > 1) <= drafts <= len(sent)


@pytest.mark.parametrize("config, message", [
    (dict(method="eagle"), r"method='eagle' is not one of \('ngram', 'draft_model'\)"),
    (dict(method="draft_model"), "method draft_model needs a model"),
    (dict(num_speculative_tokens=0), r"num_speculative_tokens=0 must be in \[1, 16\]"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), "must satisfy 1 <= min <= max"),
    (dict(num_speculative_tokens="4"), "num_speculative_tokens='4' must be an integer"),
    (dict(lookahead=3), r"unknown keys \['lookahead'\]"),
    ('{"method": ', "is not JSON"),
])
def test_bad_speculative_configs_are_refused_with_the_value(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**CONFIG, speculative_config=config)


def test_the_config_parses_vllms_json():
    config = EngineConfig(**CONFIG, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    config = EngineConfig(**CONFIG, speculative_config='{"model": "draft-dir", "num_speculative_tokens": 5}')
    assert config.speculative_config.method == "draft_model"   # a model without a method, as in vLLM


def test_the_pallas_backend_verifies_drafts_as_xla_does(tiny, plain):
    pallas = LLMEngine(EngineConfig(**{**CONFIG, "max_num_seqs": 2}, attention_backend="pallas",
                                    speculative_config=NGRAM), model=tiny)
    requests = [(COPY, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
                (PROMPTS[3], SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True,
                                            logit_bias={7: 6.0, 8: 6.0}))]
    expected, _ = run(plain, requests)
    assert samples(run(pallas, requests)[0]) == samples(expected)
    assert drafted(pallas)[1] > 0


# ---- draft models -------------------------------------------------------------------------------

def draft_config(directory, **extra):
    return EngineConfig(**CONFIG, speculative_config={"method": "draft_model", "model": str(directory),
                                                      "num_speculative_tokens": 3, **extra})


@pytest.fixture(scope="module")
def self_drafting(tiny, tiny_models):
    """The target as its own draft: every proposal is the target's own sample."""
    return LLMEngine(draft_config(tiny_models("llama")[0]), model=tiny)


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(plain, self_drafting):
    bias = {10: 6.0, 11: 6.0, 12: 6.0}
    ids = plain.tokenizer.encode(FOX, add_special_tokens=False)
    requests = [(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in PROMPTS] + [
        (COPY, SamplingParams(temperature=1.0, seed=9, top_p=0.9, max_tokens=30, ignore_eos=True, logit_bias=bias)),
        (PROMPTS[2], SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True, n=2)),
        # penalised: each draft counts the drafts before it, as the target's row after them does
        (COPY, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                              frequency_penalty=0.4)),
        (PROMPTS[3], SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, presence_penalty=0.8)),
        # constrained: the draft samples under the grammar's masks, as the target does
        *[(ids, SamplingParams(temperature=t, seed=6, max_tokens=30, logit_bias={i: 8.0 for i in ids},
                               structured_outputs=StructuredOutputsParams(choice=[FOX]))) for t in (0, 0.8)]]
    before = drafted(self_drafting)
    expected, _ = run(plain, requests)
    got, streamed = run(self_drafting, requests)
    assert samples(got) == samples(expected)
    proposed, accepted = np.subtract(drafted(self_drafting), before)
    assert proposed > 0 and accepted == proposed   # acceptance rate 1.0, sampled requests too
    assert max(len(s) for s in streamed) < 30 / 2  # 1 + 3 tokens a step, less at the start and the end


def run_steered(plain, self_drafting, requests: list) -> tuple[list, list, tuple[int, int]]:
    """`requests` through the engine without speculation and through one drafting for itself, which
    must give the same tokens: its outputs, each request's chunks a step, and (drafts, accepted)."""
    before = drafted(self_drafting)
    expected, _ = run(plain, requests)
    got, streamed = run(self_drafting, requests)
    assert samples(got) == samples(expected)
    return got, streamed, tuple(np.subtract(drafted(self_drafting), before))


def test_a_draft_model_samples_under_the_grammar(plain, self_drafting):
    """A draft model's drafts for a constrained sample are sampled under its grammar's mask after the
    drafts before them: the random model, which on its own never writes the text, proposes it, so a
    step writes several of its tokens; greedy and seeded, the engine's tokens without speculation."""
    text = f"{FOX}, {FOX}"
    ids = plain.tokenizer.encode(text, add_special_tokens=False)
    choice = StructuredOutputsParams(choice=[text])
    requests = [([3, 4, 5], SamplingParams(temperature=0, max_tokens=60, structured_outputs=choice)),
                (COPY, SamplingParams(temperature=0.8, seed=7, max_tokens=60, structured_outputs=choice))]
    got, streamed, (proposed, accepted) = run_steered(plain, self_drafting, requests)
    assert [o.outputs[0].text for o in got] == [text] * 2
    assert accepted == proposed >= len(ids)   # none without the masks: its own drafts leave the text
    assert max(len(s) for s in streamed) <= len(ids) // 3 + 2   # 1 + 3 tokens a step


def test_a_draft_model_samples_within_allowed_token_ids(plain, self_drafting):
    """allowed_token_ids steer the draft as a grammar does: the random model's own drafts mostly
    fall outside them and would be cut; under their mask each is the target's sample, so every one
    is accepted; greedy and seeded, the engine's tokens without speculation."""
    allowed = plain.tokenizer.encode(FOX, add_special_tokens=False)
    requests = [([3, 4, 5], SamplingParams(temperature=0, max_tokens=30, allowed_token_ids=allowed)),
                (COPY, SamplingParams(temperature=0.8, seed=7, max_tokens=30, allowed_token_ids=allowed))]
    got, streamed, (proposed, accepted) = run_steered(plain, self_drafting, requests)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in got)
    assert accepted == proposed >= 30   # without the masks, none survived the cut
    assert max(len(s) for s in streamed) <= 30 // 3 + 2   # 1 + 3 tokens a step


def test_each_proposal_fills_the_drafts_penalty_slot_anew(self_drafting, monkeypatch):
    """The draft runner's penalty slot counts its proposals, which the target may reject. After one
    whose last draft was rejected it has counted as many outputs as the request then has, but not
    the same ones: the next proposal fills it anew from the request's history, and adds its drafts."""
    given = recorded_slots(monkeypatch)
    proposer, allocator = self_drafting.proposer, self_drafting.allocators[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5)
    request = Request("proposed", list(COPY), params, seed=0, max_total_tokens=128)
    request.output_token_ids += [20, 21]

    def propose() -> tuple[int, ...]:
        assert allocator.allocate(request.request_id, request.num_tokens + 3) is not None
        return proposer.propose([request], [3], [allocator.block_table(request.request_id)], 0)[0]
    try:
        first = propose()
        request.output_token_ids += [*first[:2], first[2] ^ 1]   # the target kept two drafts, not the third
        second = propose()
    finally:
        allocator.free(request.request_id)
    assert [filled for _, (_, filled, _) in given] == [True, False, False] * 2
    expected = np.zeros(proposer.runner.model.config.vocab_size, np.int32)
    np.add.at(expected, request.output_token_ids + list(second), 1)
    expected[COPY] |= PROMPT_TOKEN
    np.testing.assert_array_equal(np.asarray(proposer.runner._sampled.counts)[given[-1][1][0]], expected)


def test_a_random_draft_is_mostly_rejected_and_changes_no_token(tiny, tiny_models, plain):
    engine = LLMEngine(draft_config(tiny_models("smollm2_tied")[0]), model=tiny)
    requests = [(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in PROMPTS]
    requests.append((COPY, SamplingParams(temperature=0.7, seed=4, max_tokens=30, ignore_eos=True,
                                          stop=["a"], repetition_penalty=1.2)))
    expected, _ = run(plain, requests)
    got, _ = run(engine, requests)
    assert samples(got) == samples(expected)
    proposed, accepted = drafted(engine)
    assert proposed > 0 and accepted < proposed / 2


def test_the_draft_recomputes_what_preemption_and_rejections_took(tiny, tiny_models, plain):
    """A small pool preempts; the draft's K/V follows each request's kept tokens (or its proposals
    would no longer all be accepted), so do the penalised ones' draft penalty slots, and its pages
    are the target's, all back at the end."""
    engine = LLMEngine(EngineConfig(**{**CONFIG, "num_pages": 24}, speculative_config={
        "model": str(tiny_models("llama")[0]), "num_speculative_tokens": 3}), model=tiny)
    requests = [(COPY[i:] + [i], SamplingParams(temperature=0, max_tokens=40 + i, ignore_eos=True,
                                                frequency_penalty=0.5 * (i % 2))) for i in range(6)]
    expected, _ = run(plain, requests)
    got, _ = run(engine, requests)
    assert samples(got) == samples(expected)
    proposed, accepted = drafted(engine)
    assert engine.stats().num_preemptions > 0 and accepted == proposed > 0


@pytest.mark.parametrize("variant, overrides, message", [
    ("qwen3", {}, None),   # its vocabulary matches: accepted
    ("llama", dict(vocab_size=1000), "vocabulary of 1000 tokens, the target 49152"),
    ("llama", dict(max_position_embeddings=64), "context of 64 tokens, shorter than max_model_len=128"),
])
def test_a_draft_must_share_the_vocabulary_and_hold_the_context(variant, overrides, message, tiny, tmp_path,
                                                                  smollm2_tokenizer):
    from conftest import write_tiny_model

    from jaxserve.engine.draft_model import check_draft

    write_tiny_model(tmp_path, variant, smollm2_tokenizer, **overrides)
    draft = load_model(str(tmp_path), "float32")
    if message is None:
        check_draft(draft, tiny, 128)
    else:
        with pytest.raises(ValueError, match=message):
            check_draft(draft, tiny, 128)
