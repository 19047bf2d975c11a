"""Scheduler: budgets, chunked prefill, decodes first, preemption that loses nothing."""

import dataclasses
import re

import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.ngram_proposer import NgramProposer
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import FinishReason, Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams


def make(num_pages=64, page_size=4, max_num_seqs=4, budget=32, segment=8, caching=True, **config):
    spec = config.get("speculative")
    return Scheduler(SchedulerConfig(max_num_seqs, budget, segment, **config),
                     PageAllocator(num_pages, page_size, caching), proposer=spec and NgramProposer(
                         spec.prompt_lookup_min, spec.prompt_lookup_max))


def request(name, prompt_len, max_tokens=4):
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   seed=0, max_total_tokens=prompt_len + max_tokens)


def run_step(scheduler, token=7):
    out = scheduler.schedule()
    scheduler.update(out, {s.request_id: (token,) for s in out.sequences if s.samples})
    return out


def test_long_prompt_is_chunked_and_decodes_go_first():
    s = make(budget=32, segment=8)
    s.add(request("short", 3))
    run_step(s)                                   # short's prompt, samples its first token
    s.add(request("long", 50))
    out = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in out.sequences] == [("short", 1), ("long", 24)]
    assert not out.sequences[1].samples           # a partial prefill samples nothing
    out = run_step(s)                             # 26 left would cost 32 > 31: another 24
    assert [(q.request_id, q.num_tokens, q.start_position) for q in out.sequences] == [
        ("short", 1, 4), ("long", 24, 24)]
    out = run_step(s)
    assert [(q.request_id, q.num_tokens, q.start_position) for q in out.sequences] == [
        ("short", 1, 5), ("long", 2, 48)]
    assert out.sequences[1].samples


def test_budget_counts_padded_prefill_cost():
    s = make(budget=16, segment=8)
    for i in range(3):
        s.add(request(f"r{i}", 5))                # each costs 8 of the 16
    out = s.schedule()
    assert [q.request_id for q in out.sequences] == ["r0", "r1"]


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2, budget=64)
    for i in range(3):
        s.add(request(f"r{i}", 2))
    assert len(s.schedule().sequences) == 2 and len(s.waiting) == 1


def test_preemption_recomputes_and_keeps_outputs():
    s = make(num_pages=4, page_size=4, max_num_seqs=4, budget=64)   # 3 usable pages
    s.add(request("a", 4, max_tokens=8))
    s.add(request("b", 4, max_tokens=8))
    run_step(s)                                   # both prefilled: a page each, a token each
    out = run_step(s)                             # a takes the last page; b finds none: preempted
    assert out.preempted_ids == ("b",)
    assert [q.request_id for q in out.sequences] == ["a"]
    b = s.waiting[0]
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING
    assert b.output_token_ids == [7]                # kept: recomputed, never sent twice
    while s.has_unfinished():
        run_step(s)
    assert s.allocator.num_free_pages == 3
    assert s.num_preemptions >= 1


@pytest.mark.parametrize("caching, recomputed", [(False, (1, 2, 3, 4, 7)), (True, (7,))])
def test_readmitted_request_recomputes_prompt_and_outputs(caching, recomputed):
    s = make(num_pages=4, page_size=4, budget=64, caching=caching)
    s.add(request("b", 4, max_tokens=8))
    run_step(s)
    b = s.running[0]
    s._preempt(b)
    out = s.schedule()                            # with caching, the prompt's full page is found
    assert out.sequences[0].token_ids == recomputed
    assert out.sequences[0].samples


def test_abort_frees_pages_wherever_the_request_is():
    s = make()
    s.add(request("running", 9))
    run_step(s)
    s.add(request("waiting", 9))
    assert s.abort("running").finish_reason is FinishReason.ABORT
    assert s.abort("waiting").is_finished
    assert s.abort("unknown") is None
    assert s.allocator.num_free_pages == s.allocator.num_usable_pages


# ---- priorities -----------------------------------------------------------------------------------

def prioritized(name, priority, prompt_len=4, max_tokens=4):
    r = request(name, prompt_len, max_tokens)
    r.priority = priority
    return r


def test_high_priority_request_behind_a_full_queue_starts_first():
    s = make(max_num_seqs=2, budget=64, policy="priority")
    for name in ("run0", "run1"):
        s.add(prioritized(name, 5, max_tokens=2))
    run_step(s)                                   # the batch is full
    for i in range(4):
        s.add(prioritized(f"low{i}", 5))
    s.add(prioritized("urgent", -1))
    started = []
    while s.has_unfinished():
        out = run_step(s)
        started += [q.request_id for q in out.sequences if q.start_position == 0]
    assert started[0] == "urgent" and set(started) == {"urgent", "low0", "low1", "low2", "low3"}


def test_fcfs_ignores_priority():
    s = make(max_num_seqs=1, budget=64, policy="fcfs")
    s.add(prioritized("first", 5))
    s.add(prioritized("second", -5))
    assert [q.request_id for q in s.schedule().sequences] == ["first"]


def test_a_waiting_low_priority_request_is_promoted_and_not_starved():
    s = make(max_num_seqs=1, budget=64, policy="priority", max_wait_steps=6)
    s.add(prioritized("low", 10, max_tokens=1))
    started = {}
    for step in range(40):                        # a new urgent request arrives every step
        s.add(prioritized(f"urgent{step}", 0, max_tokens=1))
        for q in run_step(s).sequences:
            started.setdefault(q.request_id, step)
    assert "low" in started and started["low"] <= 6 + 1     # without promotion it would never start


def test_preemption_picks_the_worst_ranked_running_request():
    s = make(num_pages=4, page_size=4, max_num_seqs=4, budget=64, policy="priority")   # 3 usable pages
    s.add(prioritized("important", 0, max_tokens=8))
    s.add(prioritized("minor", 9, max_tokens=8))
    run_step(s)
    out = run_step(s)                             # both need a second page; only one is free
    assert "minor" in out.preempted_ids and [q.request_id for q in out.sequences] == ["important"]


# ---- parallel samples ------------------------------------------------------------------------------

def test_forked_samples_start_from_the_first_samples_prompt_pages():
    s = make(num_pages=16, page_size=4, max_num_seqs=4, budget=64)
    samples = [request(f"r/{i}", 6, max_tokens=3) for i in range(3)]
    s.add(samples[0], forks=samples[1:])
    out = run_step(s)                             # only the first sample prefills
    assert [q.request_id for q in out.sequences] == ["r/0"] and out.sequences[0].num_tokens == 6
    out = run_step(s)                             # the others recompute the last prompt token
    assert [(q.request_id, q.num_tokens, q.start_position) for q in out.sequences] == [
        ("r/0", 1, 6), ("r/1", 1, 5), ("r/2", 1, 5)]
    shared_full_page = s.allocator.block_table("r/0")[0]
    assert all(s.allocator.block_table(f"r/{i}")[0] == shared_full_page for i in range(3))
    assert len(out.page_copies) == 2              # the half-full last page, copied for two of them
    while s.has_unfinished():
        run_step(s)
    assert s.allocator.num_free_pages == s.allocator.num_usable_pages


@pytest.mark.parametrize("caching", [True, False])
def test_pages_behind_every_layers_window_return_to_the_pool(caching):
    """With a window of 6 and pages of 4, a request holds at most three pages however long it runs
    (two of them hold the 6 keys its next query sees, one the token it writes), chunked prompt
    and decodes alike, and a second request beside it is unaffected."""
    s = make(num_pages=16, page_size=4, budget=16, segment=8, caching=caching, sliding_window=6)
    s.add(request("long", 30, max_tokens=20))
    s.add(request("short", 3, max_tokens=4))
    held = []
    while s.has_unfinished():
        out = run_step(s)
        for q in out.sequences:
            table = s.allocator.block_table(q.request_id)
            live = [i for i, page in enumerate(table) if page]
            # every page the chunk's queries see is held (and the key before: forks recompute one
            # token), none before
            assert live == list(range(max(q.start_position - 6, 0) // 4, len(table)))
            held.append(len(live))
    assert max(held) >= 3 and max(h for h in held[-10:]) <= 3
    assert s.allocator.num_free_pages == s.allocator.num_usable_pages
    # without the window the long request alone would need 50 / 4 -> 13 of the 15 pages
    unwindowed = make(num_pages=16, page_size=4, budget=16, segment=8, caching=caching)
    unwindowed.add(request("long", 30, max_tokens=20))
    peak = 0
    while unwindowed.has_unfinished():
        run_step(unwindowed)
        peak = max(peak, len(unwindowed.allocator.block_table("long")))
    assert peak == 12


def test_a_request_waits_for_seats_for_all_its_samples():
    s = make(max_num_seqs=3, budget=64)
    s.add(request("solo", 4, max_tokens=8))
    run_step(s)
    samples = [request(f"g/{i}", 4) for i in range(3)]
    s.add(samples[0], forks=samples[1:])
    assert [q.request_id for q in s.schedule().sequences] == ["solo"]


# ---- through the engine, on a tiny random model with a long context -----------------------------------

LONG = dict(page_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2304)


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm2_tokenizer):
    from conftest import write_tiny_model
    from jaxserve.checkpoint.loader import load_model

    directory = tmp_path_factory.mktemp("long_tiny")
    write_tiny_model(directory, "llama", smollm2_tokenizer, max_position_embeddings=4096)
    return load_model(str(directory), "float32")


def engine_for(model, **overrides):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(**{**LONG, "num_pages": 640, **overrides}), model=model)


@pytest.fixture(scope="module")
def cached_engine(long_tiny):
    return engine_for(long_tiny)


@pytest.fixture(scope="module")
def uncached_engine(long_tiny):
    return engine_for(long_tiny, enable_prefix_caching=False)


def record_steps(engine, monkeypatch):
    """Every SchedulerOutput the engine runs, in order."""
    steps = []
    execute = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda output, *rest: (steps.append(output), execute(output, *rest))[1])
    return steps


def finish_all(engine, on_step=None):
    finished = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if on_step:
            on_step(outputs)
        finished.update({o.request_id: o for o in outputs if o.finished})
    return finished


def greedy(max_tokens, **extra):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def prompt_of(length, start):
    return [(start + 37 * i) % 40000 + 100 for i in range(length)]


def test_second_request_prefills_only_its_suffix(cached_engine, uncached_engine, monkeypatch):
    shared = prompt_of(256, 1)
    first, second = shared + prompt_of(40, 7), shared + prompt_of(23, 9)
    steps = record_steps(cached_engine, monkeypatch)
    hits_before = cached_engine.stats().prefix_cache_hits
    cached_engine.add_request(first, greedy(8), request_id="first")
    finish_all(cached_engine)
    cached_engine.add_request(second, greedy(8), request_id="second")
    with_cache = finish_all(cached_engine)["second"].outputs[0].token_ids
    prefilled = sum(q.num_tokens for step in steps for q in step.sequences
                    if q.request_id == "second/0" and q.start_position < len(second))
    assert prefilled == len(second) - 256           # the 16 shared pages came from the cache
    assert cached_engine.stats().prefix_cache_hits - hits_before == 256
    uncached_engine.add_request(second, greedy(8), request_id="second")
    assert finish_all(uncached_engine)["second"].outputs[0].token_ids == with_cache


def test_n_samples_share_the_prompt_pages(uncached_engine):
    prompt, params = prompt_of(512, 3), SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)

    def peak_pages(submit):
        peak = []
        allocator = uncached_engine.allocators[0]
        submit()
        finished = finish_all(uncached_engine, lambda _: peak.append(
            allocator.num_usable_pages - allocator.num_free_pages))
        return max(peak), finished

    shared_peak, shared = peak_pages(lambda: uncached_engine.add_request(prompt, dataclasses.replace(params, n=8),
                                                                         request_id="n8"))
    separate_peak, _ = peak_pages(lambda: [uncached_engine.add_request(prompt, params) for _ in range(8)])
    assert shared_peak * 4 <= separate_peak, (shared_peak, separate_peak)
    uncached_engine.add_request(prompt, dataclasses.replace(params, n=8), request_id="again")
    again = finish_all(uncached_engine)["again"]
    samples = [o.token_ids for o in shared["n8"].outputs]
    assert [o.token_ids for o in again.outputs] == samples and len({tuple(t) for t in samples}) == 8


def test_long_prompt_is_chunked_while_streams_keep_decoding(cached_engine, monkeypatch):
    streams = [cached_engine.add_request(prompt_of(20, i), greedy(40)) for i in range(7)]
    finish_steps = []
    while len(finish_steps) < 2:                    # the 7 streams are decoding
        finish_steps.append(cached_engine.step())
    steps = record_steps(cached_engine, monkeypatch)
    cached_engine.add_request(prompt_of(2000, 999), greedy(4), request_id="long")
    moved_per_step = []
    while not any(q.request_id == "long/0" and q.samples for step in steps for q in step.sequences):
        moved_per_step.append({o.request_id for o in cached_engine.step()})
    chunks = [q.num_tokens for step in steps for q in step.sequences if q.request_id == "long/0"]
    assert len(chunks) >= 8 and sum(chunks) == 2000 and max(chunks) <= 256
    assert all(moved >= set(streams) for moved in moved_per_step)   # every stream got a token every step
    finish_all(cached_engine)


def test_preempted_requests_finish_with_the_tokens_of_a_large_pool(long_tiny, uncached_engine, monkeypatch):
    small = engine_for(long_tiny, max_model_len=256, num_pages=18)     # 17 pages; one sequence needs 16
    # Every fourth request is constrained: its grammar must survive being preempted and recomputed.
    words = StructuredOutputsParams(regex="[a-z]+( [a-z]+)*")
    requests = [(prompt_of(17 + 5 * i, i), greedy(24 + i, structured_outputs=words if i % 4 == 0 else None))
                for i in range(32)]
    for i, (prompt, params) in enumerate(requests):
        small.add_request(prompt, params, request_id=str(i))
        uncached_engine.add_request(prompt, params, request_id=str(i))
    steps = record_steps(small, monkeypatch)
    got, expected = finish_all(small), finish_all(uncached_engine)
    preempted = {int(r.split("/")[0]) for step in steps for r in step.preempted_ids}
    assert any(i % 4 == 0 for i in preempted)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {
        k: v.outputs[0].token_ids for k, v in expected.items()}
    assert all(re.fullmatch("[a-z]+( [a-z]+)* ?", got[str(i)].outputs[0].text) for i in range(0, 32, 4))
    assert small.stats().kv_cache_usage == 0


# ---- speculative decoding (n-gram) -------------------------------------------------------------

def speculating(**config):
    return make(page_size=2, speculative=SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2),
                **config)


def repeating(name, max_tokens=10):
    prompt = [1, 2, 3, 4, 1, 2, 3]
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens), seed=0,
                   max_total_tokens=len(prompt) + max_tokens)


def test_a_decode_gets_the_ngram_drafts_and_keeps_the_run_its_samples_confirm():
    s = speculating()
    s.add(repeating("r"))
    run_step(s, token=4)                          # prefill; "1 2 3 4" recurs: drafts 1 2 3 follow
    out = s.schedule()
    (seq,) = out.sequences
    assert (seq.token_ids, seq.draft_token_ids, seq.start_position) == ((4, 1, 2, 3), (1, 2, 3), 7)
    assert len(seq.block_table) == 6              # room for all 11 tokens
    advanced = s.update(out, {"r": (1, 2, 9)})    # drafts 1, 2 confirmed, then 9 instead of 3
    request = s.running[0]
    assert advanced == {request: (1, 2, 9)}
    assert request.output_token_ids == [4, 1, 2, 9]
    assert request.num_computed_tokens == 10      # the prompt, 4, and the confirmed 1 2; 9 is next
    assert s.counters.spec_decode_num_accepted_tokens == 2
    assert s.counters.spec_decode_num_accepted_tokens_per_pos == [1, 1, 0]


def test_rejected_drafts_return_their_pages():
    s = speculating()
    s.add(repeating("r"))
    run_step(s, token=4)
    free = s.allocator.num_free_pages
    out = s.schedule()
    assert s.allocator.num_free_pages == free - 2  # pages for 11 tokens where 8 needed 4
    s.update(out, {"r": (9,)})                    # the first draft is wrong: only the sample counts
    assert s.allocator.num_free_pages == free - 1  # 9 tokens: the 5th page stays, the 6th returns
    assert s.running[0].num_computed_tokens == 8
    assert (s.counters.spec_decode_num_drafts, s.counters.spec_decode_num_draft_tokens,
            s.counters.spec_decode_num_accepted_tokens) == (1, 3, 0)


def test_drafts_beside_a_prompt_chunk_none_above_the_batch_cut_off_or_past_max_tokens():
    s = speculating()
    s.add(repeating("a"))
    run_step(s, token=4)
    s.add(Request("new", [20, 21, 22, 23, 24], SamplingParams(max_tokens=4), seed=0, max_total_tokens=9))
    decode, prompt = run_step(s, token=4).sequences         # the prompt's chunk left 32 - 8 tokens of budget
    assert decode.draft_token_ids == (1, 2, 3) and prompt.draft_token_ids == ()
    s.add(repeating("b"))
    run_step(s, token=4)
    assert len(run_step(s, token=4).sequences) == 3 and s.counters.spec_decode_num_drafts == 1
    t = speculating()
    t.add(repeating("short", max_tokens=3))
    run_step(t, token=4)
    (seq,) = t.schedule().sequences
    assert seq.draft_token_ids == (1,)            # 1 output; a draft and one more reach max_tokens=3


def test_drafts_only_where_pages_are_free():
    s = speculating(num_pages=5)                  # 4 usable pages of 2 tokens: the 8 tokens fill them
    s.add(repeating("r"))
    run_step(s, token=4)
    (seq,) = s.schedule().sequences
    assert seq.draft_token_ids == () and s.num_preemptions == 0
