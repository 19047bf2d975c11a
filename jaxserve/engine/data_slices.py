"""Data-parallel slices on the host: one scheduler and page allocator per slice of the mesh's
`data` axis, behind the one scheduler interface the engine calls.

Each slice owns its part of the KV pool (page ids local to the slice, its own reserved page 0, its
own prefix cache) and schedules its own requests under the per-slice limits (`max_num_seqs`, the
token budget), so a step holds up to D times what one slice holds. A new request goes to the
least-loaded slice (fewest sequences, then fewest pages in use, then the lowest index) and stays
there: its other samples, its preemption and its recomputation all happen inside its slice.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence

from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import FinishReason, Request
from jaxserve.engine.scheduler import Proposer, Scheduler, SchedulerConfig, SchedulerCounters
from jaxserve.engine.scheduler_output import SchedulerOutput


def _add(values: Iterable):
    """The slices' sum of one counter: a number, or a list of per-position counts."""
    values = list(values)
    if isinstance(values[0], list):
        return [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
    return sum(values)


class SlicedScheduler:
    def __init__(self, config: SchedulerConfig, allocators: list[PageAllocator], proposer: Proposer | None = None):
        self.slices = [Scheduler(config, allocator, i, proposer) for i, allocator in enumerate(allocators)]
        for s in self.slices:   # max_loras counts the adapters of every slice: they share the slots
            s.peers = self.slices
        self.pages_per_slice = allocators[0].num_pages
        self._slice_of: dict[str, int] = {}

    @property
    def running(self) -> list[Request]:
        return [r for s in self.slices for r in s.running]

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.slices)

    @property
    def counters(self) -> SchedulerCounters:
        return SchedulerCounters(*(_add(getattr(s.counters, f.name) for s in self.slices)
                                   for f in dataclasses.fields(SchedulerCounters)))

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.slices)

    def add(self, request: Request, forks: list[Request] = ()) -> None:
        """Queues `request` and its `forks` on the least-loaded slice."""
        index = min(range(len(self.slices)), key=self._load)
        self.slices[index].add(request, forks)
        for r in (request, *forks):
            self._slice_of[r.request_id] = index

    def _load(self, index: int) -> tuple[int, int, int]:
        s = self.slices[index]
        pages_in_use = s.allocator.num_usable_pages - s.allocator.num_free_pages
        return len(s.running) + s.num_waiting, pages_in_use, index

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        index = self._slice_of.pop(request_id, None)
        return None if index is None else self.slices[index].abort(request_id, reason)

    def schedule(self) -> SchedulerOutput:
        outputs = [s.schedule() for s in self.slices]
        if len(outputs) == 1:
            return outputs[0]
        size = self.pages_per_slice
        return SchedulerOutput(
            tuple(seq for o in outputs for seq in o.sequences),
            tuple(r for o in outputs for r in o.preempted_ids),
            tuple((src + i * size, dst + i * size) for i, o in enumerate(outputs) for src, dst in o.page_copies))

    def update(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> dict[Request, tuple[int, ...]]:
        if len(self.slices) == 1:
            advanced = self.slices[0].update(output, sampled)
        else:
            by_slice = [[] for _ in self.slices]
            for seq in output.sequences:
                by_slice[seq.data_slice].append(seq)
            advanced = {r: run for s, seqs in zip(self.slices, by_slice)
                        for r, run in s.update(SchedulerOutput(tuple(seqs)), sampled).items()}
        for request in advanced:
            if request.is_finished:
                self._slice_of.pop(request.request_id, None)
        return advanced

    def kv_cache_usage(self) -> float:
        """Fraction of the usable pages of all slices in use."""
        usable = sum(s.allocator.num_usable_pages for s in self.slices)
        free = sum(s.allocator.num_free_pages for s in self.slices)
        return (usable - free) / max(usable, 1)

    def clear_cache(self) -> None:
        for s in self.slices:
            s.allocator.clear_cache()
