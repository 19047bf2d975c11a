"""Host-side bookkeeping of the KV page pool: a free list, block tables and reference counts.

Page 0 is never handed out: padded batch slots write there. A page is free exactly when its
reference count is 0; sequences that share a page (a forked sample) each hold one reference.
"""

from __future__ import annotations

import collections
import math


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved for padding)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = collections.deque(range(1, num_pages))
        self._refcounts = [0] * num_pages
        self._tables: dict[str, list[int]] = {}

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_new_pages(self, seq_id: str, num_tokens: int) -> int:
        """Pages `seq_id` still needs to hold `num_tokens` tokens."""
        return max(0, self.pages_for(num_tokens) - len(self.block_table(seq_id)))

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grows `seq_id`'s table to hold `num_tokens`; all or nothing. False if pages are short."""
        needed = self.num_new_pages(seq_id, num_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            page = self._free.popleft()
            self._refcounts[page] = 1
            table.append(page)
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """Gives `child_id` the parent's pages by reference (the caller copies a page before writing it)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already holds pages")
        table = list(self.block_table(parent_id))
        for page in table:
            self._refcounts[page] += 1
        self._tables[child_id] = table

    def free(self, seq_id: str) -> None:
        """Drops `seq_id`'s references; pages no one references go back to the free list."""
        for page in self._tables.pop(seq_id, []):
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]
