"""PageAllocator: never hands out a page twice, every page comes back, cached pages are shared,
copied before they are written, and evicted least recently released first, never while live."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.page_allocator import PageAllocator, page_hashes


def test_page_zero_is_reserved_and_tables_grow_by_pages():
    allocator = PageAllocator(num_pages=5, page_size=4)
    assert allocator.allocate("a", 5) == []
    assert allocator.block_table("a") == [1, 2]
    assert allocator.allocate("a", 8) == [] and allocator.block_table("a") == [1, 2]
    assert allocator.allocate("b", 9) is None        # needs 3, only 2 free: all or nothing
    assert allocator.block_table("b") == [] and allocator.num_free_pages == 2
    allocator.free("a")
    assert allocator.num_free_pages == 4


def test_forked_pages_are_freed_by_the_last_holder():
    allocator = PageAllocator(num_pages=4, page_size=2)
    allocator.allocate("parent", 4)
    allocator.fork("parent", "child", 4)
    assert allocator.refcount(allocator.block_table("parent")[0]) == 2
    allocator.free("parent")
    assert allocator.num_free_pages == 1
    allocator.free("child")
    assert allocator.num_free_pages == 3


def test_pages_behind_a_window_are_released_and_their_slots_hold_page_zero():
    allocator = PageAllocator(num_pages=8, page_size=4)
    allocator.allocate("a", 14)                       # pages 1-4
    allocator.cache_pages("a", page_hashes(list(range(14)), 4, []), 1)   # page 1 cached
    allocator.fork("a", "b", 14)
    assert allocator.release_before("a", 11) == 2     # positions 0-7: pages 1 and 2
    assert allocator.block_table("a") == [0, 0, 3, 4] and allocator.release_before("a", 11) == 0
    assert allocator.refcount(1) == allocator.refcount(2) == 1   # still b's
    allocator.fork("a", "c", 14)                      # a fork takes no reference to page 0
    assert allocator.block_table("c") == [0, 0, 3, 4] and allocator.refcount(0) == 0
    allocator.release_before("b", 16)                 # b's whole table
    assert allocator.evictable_pages() == [1] and allocator.num_free_pages == 3 + 2   # 5-7, then 1 and 2
    allocator.cache_pages("c", page_hashes(list(range(14)), 4, []), 3)   # page 0 is never cached
    assert allocator.cached_hash(0) is None
    allocator.truncate("c", 1)
    for seq in ("a", "b", "c"):
        allocator.free(seq)
    assert allocator.num_free_pages == allocator.num_usable_pages and allocator.refcount(0) == 0


def test_writing_a_shared_page_copies_it_first():
    allocator = PageAllocator(num_pages=8, page_size=4)
    allocator.allocate("parent", 6)                   # pages 1 (full) and 2 (half)
    allocator.fork("parent", "child", 6)
    copies = allocator.allocate("child", 7, write_from=6)
    assert copies == [(2, 3)]
    assert allocator.block_table("child") == [1, 3] and allocator.block_table("parent") == [1, 2]
    assert allocator.allocate("parent", 7, write_from=6) == []   # the last holder writes in place


def test_hashes_chain_over_the_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    b = page_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]   # same tokens, different prefix
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, list(a))[:2] == a


def test_cached_prefix_is_shared_and_outlives_its_request():
    allocator = PageAllocator(num_pages=8, page_size=4)
    tokens = list(range(10))
    hashes = page_hashes(tokens, 4, [])
    allocator.allocate("a", 10)
    allocator.cache_pages("a", hashes)
    allocator.free("a")
    assert allocator.num_free_pages == 7 and allocator.evictable_pages() == [2, 1]
    assert allocator.match_prefix("b", hashes) == 2 and allocator.block_table("b") == [1, 2]
    assert allocator.evictable_pages() == []


def test_a_lost_pool_clears_the_cache():
    allocator = PageAllocator(num_pages=8, page_size=4)
    hashes = page_hashes(list(range(8)), 4, [])
    allocator.allocate("a", 8)
    allocator.cache_pages("a", hashes)
    allocator.free("a")
    allocator.clear_cache()
    assert allocator.match_prefix("b", hashes) == 0 and allocator.num_free_pages == 7
    assert allocator.evictable_pages() == []


def test_caching_off_matches_nothing():
    allocator = PageAllocator(num_pages=8, page_size=4, enable_caching=False)
    hashes = page_hashes(list(range(8)), 4, [])
    allocator.allocate("a", 8)
    allocator.cache_pages("a", hashes)
    allocator.free("a")
    assert allocator.match_prefix("b", hashes) == 0 and allocator.num_cached_pages == 0


def test_a_table_snapshot_is_made_anew_exactly_when_its_table_changes():
    allocator = PageAllocator(num_pages=12, page_size=4, enable_caching=False)
    allocator.allocate("a", 5)
    first = allocator.table_snapshot("a")
    assert first.tolist() == [1, 2] and first.dtype == np.int32 and not first.flags.writeable
    allocator.allocate("a", 8)                        # the same two pages
    assert allocator.table_snapshot("a") is first
    allocator.fork("a", "b", 8)
    changes = [lambda: allocator.allocate("a", 13),            # a page added
               lambda: allocator.allocate("b", 8, write_from=6),   # a shared page copied on write
               lambda: allocator.truncate("a", 9),
               lambda: allocator.release_before("a", 4)]
    for change in changes:
        before = {seq: allocator.table_snapshot(seq) for seq in ("a", "b")}
        change()
        for seq in ("a", "b"):
            now = allocator.table_snapshot(seq)
            assert now.tolist() == allocator.block_table(seq)
            assert (now is before[seq]) == (now.tolist() == before[seq].tolist())
    allocator.free("a")
    assert allocator.table_snapshot("a").tolist() == []


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="num_pages=1"):
        PageAllocator(num_pages=1, page_size=16)


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]
operations = st.lists(st.tuples(st.sampled_from(["admit", "grow", "fork", "free"]), st.integers(0, 5),
                                st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(0, 3), max_size=9)),
                      min_size=10, max_size=120)


class Model:
    """What the allocator must guarantee, tracked independently of it."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.tokens: dict[str, list[int]] = {}       # each live sequence's tokens, all computed
        self.content: dict[int, tuple] = {}          # each page: the tokens last written into it

    def write(self, seq_id: str, start: int, copies) -> None:
        for source, destination in copies:
            self.content[destination] = self.content.get(source, ())
        size, tokens, table = self.allocator.page_size, self.tokens[seq_id], self.allocator.block_table(seq_id)
        for index in range(start // size, len(table)):
            self.content[table[index]] = tuple(tokens[index * size:(index + 1) * size])
        self.allocator.cache_pages(seq_id, page_hashes(tokens, size, [])[:len(tokens) // size])

    def check(self) -> None:
        holders: dict[int, int] = {}
        size = self.allocator.page_size
        for seq_id, tokens in self.tokens.items():
            table = self.allocator.block_table(seq_id)
            assert len(table) == self.allocator.pages_for(len(tokens))
            assert self.allocator.table_snapshot(seq_id).tolist() == table   # kept from the last check if unchanged
            for index, page in enumerate(table):
                assert page != 0
                assert self.content[page][:len(tokens[index * size:(index + 1) * size])] == tuple(
                    tokens[index * size:(index + 1) * size])
                holders[page] = holders.get(page, 0) + 1
        for page, count in holders.items():
            assert self.allocator.refcount(page) == count
        assert self.allocator.num_free_pages + len(holders) == self.allocator.num_pages - 1


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(4, 16), st.sampled_from([1, 2, 4]))
def test_random_traffic_shares_copies_and_evicts_in_lru_order(ops, num_pages, page_size):
    allocator = PageAllocator(num_pages, page_size)
    model = Model(allocator)
    for op, seq, prefix, suffix in ops:
        seq_id = f"s{seq}"
        evictable_before = [(p, allocator.cached_hash(p)) for p in allocator.evictable_pages()]
        live_cached = {(p, allocator.cached_hash(p)) for t in model.tokens for p in allocator.block_table(t)
                       if allocator.cached_hash(p)}
        if op == "admit" and seq_id not in model.tokens:
            tokens = PREFIXES[prefix] + suffix
            hashes = page_hashes(tokens, page_size, [])[:(len(tokens) - 1) // page_size]
            hits = allocator.match_prefix(seq_id, hashes)
            model.tokens[seq_id] = tokens
            copies = allocator.allocate(seq_id, len(tokens), write_from=hits * page_size)
            if copies is None:
                allocator.free(seq_id)
                del model.tokens[seq_id]
            else:
                assert copies == []                   # fresh pages after a cached prefix
                model.write(seq_id, hits * page_size, copies)
        elif op == "grow" and seq_id in model.tokens and suffix:
            start = len(model.tokens[seq_id])
            copies = allocator.allocate(seq_id, start + len(suffix), write_from=start)
            if copies is not None:
                model.tokens[seq_id] += suffix
                model.write(seq_id, start, copies)
        elif op == "fork" and seq_id in model.tokens and f"{seq_id}c" not in model.tokens:
            allocator.fork(seq_id, f"{seq_id}c", len(model.tokens[seq_id]))
            model.tokens[f"{seq_id}c"] = list(model.tokens[seq_id])
        elif op == "free":
            allocator.free(seq_id)
            model.tokens.pop(seq_id, None)
        reused = {(p, h) for p, h in evictable_before if allocator.cached_hash(p) == h and allocator.refcount(p)}
        candidates = [page for page in evictable_before if page not in reused]   # not taken back by a match
        evicted = [(p, h) for p, h in candidates if allocator.cached_hash(p) != h]
        assert evicted == candidates[:len(evicted)]                   # least recently released first
        assert all(allocator.cached_hash(p) == h for p, h in live_cached)  # a live page is never evicted
        model.check()
    for seq_id in list(model.tokens):
        allocator.free(seq_id)
    assert allocator.num_free_pages == num_pages - 1
