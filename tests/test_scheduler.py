"""Scheduler: budgets, chunked prefill, decodes first, preemption that loses nothing."""

import pytest

from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import FinishReason, Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig
from jaxserve.sampling_params import SamplingParams


def make(num_pages=64, page_size=4, max_num_seqs=4, budget=32, segment=8, caching=True, **config):
    return Scheduler(SchedulerConfig(max_num_seqs, budget, segment, **config),
                     PageAllocator(num_pages, page_size, caching))


def request(name, prompt_len, max_tokens=4):
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   seed=0, max_total_tokens=prompt_len + max_tokens)


def run_step(scheduler, token=7):
    out = scheduler.schedule()
    scheduler.update(out, {s.request_id: token for s in out.sequences if s.samples})
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
