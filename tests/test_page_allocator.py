"""PageAllocator: never hands out a page twice, and every page comes back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.page_allocator import PageAllocator


def test_page_zero_is_reserved_and_tables_grow_by_pages():
    allocator = PageAllocator(num_pages=5, page_size=4)
    assert allocator.allocate("a", 5)
    assert allocator.block_table("a") == [1, 2]
    assert allocator.allocate("a", 8) and allocator.block_table("a") == [1, 2]
    assert not allocator.allocate("b", 9)           # needs 3, only 2 free: all or nothing
    assert allocator.block_table("b") == [] and allocator.num_free_pages == 2
    allocator.free("a")
    assert allocator.num_free_pages == 4


def test_forked_pages_are_freed_by_the_last_holder():
    allocator = PageAllocator(num_pages=4, page_size=2)
    allocator.allocate("parent", 4)
    allocator.fork("parent", "child")
    assert allocator.refcount(allocator.block_table("parent")[0]) == 2
    allocator.free("parent")
    assert allocator.num_free_pages == 1
    allocator.free("child")
    assert allocator.num_free_pages == 3


def test_too_small_pool_is_refused():
    with pytest.raises(ValueError, match="num_pages=1"):
        PageAllocator(num_pages=1, page_size=16)


operations = st.lists(st.tuples(st.sampled_from(["grow", "finish", "abort", "fork"]),
                                 st.integers(0, 7), st.integers(1, 40)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(2, 40), st.sampled_from([1, 4, 16]))
def test_random_traffic_never_double_allocates_and_returns_every_page(ops, num_pages, page_size):
    allocator = PageAllocator(num_pages, page_size)
    lengths: dict[str, int] = {}
    for op, seq, grow in ops:
        seq_id = f"s{seq}"
        if op == "grow":
            wanted = lengths.get(seq_id, 0) + grow
            if allocator.allocate(seq_id, wanted):
                lengths[seq_id] = wanted
        elif op == "fork" and seq_id in lengths and f"{seq_id}c" not in lengths:
            allocator.fork(seq_id, f"{seq_id}c")
            lengths[f"{seq_id}c"] = lengths[seq_id]
        elif op in ("finish", "abort"):
            allocator.free(seq_id)
            lengths.pop(seq_id, None)
        _check_invariants(allocator, lengths)
    for seq_id in list(lengths):
        allocator.free(seq_id)
    assert allocator.num_free_pages == num_pages - 1


def _check_invariants(allocator, lengths):
    holders: dict[int, int] = {}
    for seq_id, length in lengths.items():
        table = allocator.block_table(seq_id)
        assert len(table) == allocator.pages_for(length)
        assert len(set(table)) == len(table)
        for page in table:
            assert page != 0
            holders[page] = holders.get(page, 0) + 1
    for page, count in holders.items():
        assert allocator.refcount(page) == count
    assert allocator.num_free_pages + len(holders) == allocator.num_pages - 1
