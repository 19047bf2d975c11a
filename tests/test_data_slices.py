"""Data-parallel slices on the host: least-loaded placement, per-slice pages, one scheduler interface."""

from jaxserve.engine.data_slices import SlicedScheduler
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import SchedulerConfig
from jaxserve.sampling_params import SamplingParams

PAGES = 16


def make(num_slices=2, max_num_seqs=4):
    return SlicedScheduler(SchedulerConfig(max_num_seqs, 64, 8),
                           [PageAllocator(PAGES, 4, True) for _ in range(num_slices)])


def request(name, prompt_len, max_tokens=3, n=1):
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, n=n),
                   seed=0, max_total_tokens=prompt_len + max_tokens)


def run_step(s, token=7):
    out = s.schedule()
    return out, s.update(out, {q.request_id: (token,) for q in out.sequences if q.samples})


def test_requests_go_to_the_least_loaded_slice_and_stay_there():
    s = make(num_slices=3)
    for i in range(5):
        s.add(request(f"r{i}", 6))
    out, _ = run_step(s)
    assert {q.request_id: q.data_slice for q in out.sequences} == {"r0": 0, "r1": 1, "r2": 2, "r3": 0, "r4": 1}
    s.abort("r2")                          # slice 2 is now the emptiest
    s.add(request("late", 6))
    out, _ = run_step(s)
    assert {q.request_id: q.data_slice for q in out.sequences}["late"] == 2
    assert all(q.data_slice == {"r0": 0, "r1": 1, "r3": 0, "r4": 1, "late": 2}[q.request_id] for q in out.sequences)


def test_each_slice_has_its_own_pages_and_page_zero():
    s = make()
    s.add(request("a", 9))
    s.add(request("b", 9))
    out, _ = run_step(s)
    tables = {q.request_id: list(q.block_table) for q in out.sequences}
    assert tables["a"] == tables["b"]      # local page ids: the same numbers, different slices
    assert 0 not in tables["a"] and max(tables["a"]) < PAGES
    assert [a.num_usable_pages - a.num_free_pages for a in (sl.allocator for sl in s.slices)] == [3, 3]


def test_samples_fork_inside_their_slice_with_global_page_copies():
    s = make()
    s.add(request("first", 6))             # slice 0
    s.add(request("x/0", 6), forks=[request("x/1", 6)])   # slice 1: its fork stays there
    run_step(s)
    out, _ = run_step(s)
    assert {q.request_id: q.data_slice for q in out.sequences}["x/1"] == 1
    assert out.page_copies and all(PAGES <= page < 2 * PAGES for pair in out.page_copies for page in pair)


def test_counters_and_usage_sum_over_slices_and_everything_is_freed():
    s = make()
    for i in range(4):
        s.add(request(f"r{i}", 5))
    assert s.num_waiting == 4
    run_step(s)
    assert len(s.running) == 4 and 0 < s.kv_cache_usage() < 1
    assert s.counters.prefix_cache_queries == 4 * 5
    while s.has_unfinished():
        run_step(s)
    assert s.kv_cache_usage() == 0 and s.running == [] and s.abort("r0") is None
