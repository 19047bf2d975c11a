"""Continuous batching: which sequences compute how many tokens in the next step.

Every request has `num_computed_tokens`; a step computes some of the rest. Running requests go
first (so decodes never wait behind a long prompt), in arrival order, then waiting requests are
admitted first come, first served, while the token budget, `max_num_seqs` and free pages last. A
prompt that does not fit the budget is prefilled in chunks over several steps.

The budget counts a multi-token chunk at its size rounded up to `prefill_segment`, the unit in
which the runner lays out prefill queries, so a step never holds more padded tokens than the budget.

When a running request needs a page and none is free, the latest-arrived running request is
preempted: its pages are freed and it goes back to the front of the queue, to recompute its prompt
and its outputs so far when it is readmitted (nothing already returned is returned again).
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import FinishReason, Request, RequestStatus
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_segment: int

    def chunk_cost(self, num_tokens: int) -> int:
        if num_tokens == 1:
            return 1
        return -(-num_tokens // self.prefill_segment) * self.prefill_segment

    def largest_chunk(self, num_tokens: int, budget: int) -> int:
        """The most of `num_tokens` whose cost fits in `budget` (0 if none)."""
        if self.chunk_cost(num_tokens) <= budget:
            return num_tokens
        return min(num_tokens, budget // self.prefill_segment * self.prefill_segment or min(budget, 1))


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finishes a waiting or running request and frees its pages; None if it is not here."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.allocator.free(request_id)
                    request.finish(reason)
                    return request
        return None

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted to make room for an earlier one
            num_tokens = self.config.largest_chunk(request.num_uncomputed_tokens, budget)
            if num_tokens == 0:
                break
            if not self._allocate_or_preempt(request, num_tokens, preempted):
                continue
            scheduled.append((request, num_tokens))
            budget -= self.config.chunk_cost(num_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            num_tokens = self.config.largest_chunk(request.num_uncomputed_tokens, budget)
            if num_tokens == 0 or not self.allocator.allocate(
                    request.request_id, request.num_computed_tokens + num_tokens):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_tokens))
            budget -= self.config.chunk_cost(num_tokens)
        return SchedulerOutput(tuple(self._describe(r, n) for r, n in scheduled), tuple(preempted))

    def _allocate_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Pages for `request`'s chunk, preempting the latest running requests if needed.
        False if `request` itself had to be preempted."""
        while not self.allocator.allocate(request.request_id, request.num_computed_tokens + num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _describe(self, request: Request, num_tokens: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=tuple(request.token_slice(start, start + num_tokens)),
            start_position=start,
            block_table=tuple(self.allocator.block_table(request.request_id)),
            samples=start + num_tokens == request.num_tokens,
            params=request.params,
            seed=request.seed,
            num_output_tokens=len(request.output_token_ids),
        )

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances every scheduled request by its chunk, appends its sampled token, retires the
        finished. Returns the requests that received a token."""
        by_id = {r.request_id: r for r in self.running}
        advanced = []
        for seq in output.sequences:
            request = by_id.get(seq.request_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_computed_tokens += seq.num_tokens
            if seq.samples:
                request.append_token(sampled[seq.request_id])
                advanced.append(request)
                if request.is_finished:
                    self.running.remove(request)
                    self.allocator.free(request.request_id)
        return advanced
