"""Continuous batching: which sequences compute how many tokens in the next step.

Every request has `num_computed_tokens`; a step computes some of the rest. Running requests go
first (so decodes never wait behind a long prompt), then waiting requests are admitted in rank
order while the token budget, `max_num_seqs` and free pages last. With chunked prefill a prompt
that does not fit what is left of the budget is prefilled in chunks over several steps; without
it a prompt waits until it fits whole.

The budget counts a multi-token chunk at its size rounded up to `prefill_segment`, the unit in
which the runner lays out prefill queries, so a step never holds more padded tokens than the budget.

Prefix caching: an admitted request first takes the cached pages of its longest cached prefix
(whole pages, and never its last token, which must be computed to sample from) and computes only
the rest. Pages are registered in the cache as they fill.

Parallel samples (n > 1): the first sample prefills the prompt; when it samples its first token
the others fork its prompt pages by reference and each recomputes only the prompt's last token,
into a private copy of the last page (copy on write). A request is admitted only with room in
`max_num_seqs` for all of its samples.

Rank: under `fcfs`, arrival order; under `priority`, (priority, arrival), lower first. A request
that has spent `max_wait_steps` steps waiting is promoted: it ranks ahead of every unpromoted
request, promoted requests among themselves by arrival. So no request starves: once promoted, only
requests that arrived before it can be admitted or keep running ahead of it.

Preemption: when a running request needs a page and none is free (after evicting cached pages),
the running request of the worst rank is preempted: its pages are freed and it waits again, to
recompute its prompt and its outputs so far when it is readmitted (nothing already returned is
returned again; with prefix caching most of it is found in the cache).

Speculative decoding: in a step of at most `disable_by_batch_size` sequences, each decoding
request may get up to K drafts (fewer near its max_tokens or the context), from the
`Proposer` (n-gram lookup, or a draft model's device calls): its chunk is its last token and the
drafts, whose pages it takes if they are free (never by preempting); the pages of drafts not
proposed go back at once. When the step is read back, the drafts the target's own samples confirm
count as computed and the pages past its end go back to the pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import FinishReason, Request, RequestStatus
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_segment: int
    chunked_prefill: bool = True
    policy: str = "fcfs"            # or "priority"
    max_wait_steps: int = 256       # waiting steps after which a request outranks every priority
    speculative: SpeculativeConfig | None = None
    max_loras: int = 0              # distinct LoRA adapters running at once; 0: no adapters served
    sliding_window: int | None = None   # every layer's window, when all have one: pages behind it are released

    def chunk_cost(self, num_tokens: int) -> int:
        if num_tokens == 1:
            return 1
        return -(-num_tokens // self.prefill_segment) * self.prefill_segment

    def largest_chunk(self, num_tokens: int, budget: int) -> int:
        """The most of `num_tokens` whose cost fits in `budget` (0 if none)."""
        if self.chunk_cost(num_tokens) <= budget:
            return num_tokens
        if not self.chunked_prefill:
            return 0
        return min(num_tokens, budget // self.prefill_segment * self.prefill_segment or min(budget, 1))


@dataclasses.dataclass
class SchedulerCounters:
    """Since start; tokens as vLLM counts them."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0     # tokens of admitted requests looked up
    prefix_cache_hits: int = 0        # of those, tokens found cached
    spec_decode_num_drafts: int = 0            # sequences given drafts (vLLM's names)
    spec_decode_num_draft_tokens: int = 0      # drafts proposed
    spec_decode_num_accepted_tokens: int = 0   # drafts the target's samples confirmed
    spec_decode_num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)   # [i]: at draft i


# (requests, each one's drafts so far) -> the packed allowed-token mask after them of each request
# whose samples a grammar or allowed_token_ids constrain, by id (structured_output.ConstrainedProposals.masks_after)
MasksAfter = Callable[[list[Request], list[tuple[int, ...]]], Mapping[str, Sequence[int]]]


class Proposer(Protocol):
    """Speculative drafts for decoding requests (`jaxserve.engine.ngram_proposer`, `.draft_model`)."""

    def propose(self, requests: list[Request], rooms: list[int], tables: list[list[int]],
                data_slice: int, masks_after: MasksAfter | None = None) -> list[tuple[int, ...]]:
        """Up to rooms[i] tokens to follow requests[i]'s tokens (its last one included, which this
        step computes); tables[i]: its pages, with room for the drafts. A draft model writes its
        own K/V there, in a pool of its own, and records how far in `num_draft_computed_tokens`.
        `masks_after`: the allowed-token masks of the constrained requests after given drafts, for
        a proposer that samples (a draft model samples under them; n-gram proposals are cut)."""
        ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, data_slice: int = 0,
                 proposer: Proposer | None = None):
        self.config = config
        self.proposer = proposer        # given with config.speculative
        self.peers = [self]             # the schedulers sharing the device's LoRA slots (data slices)
        self.allocator = allocator
        self.data_slice = data_slice    # the mesh's data slice whose part of the pool `allocator` manages
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        self._forks: dict[str, list[Request]] = {}     # first sample's id -> samples waiting to fork
        self._arrivals = itertools.count()
        # a request's rank, the sort key: lower runs first (a key of one attribute sorts the running
        # requests in a third of the time a method's tuple took)
        self.rank = self._priority_rank if config.policy == "priority" else operator.attrgetter("arrival_index")

    @property
    def num_preemptions(self) -> int:
        return self.counters.num_preemptions

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(f) for f in self._forks.values())

    def add(self, request: Request, forks: list[Request] = ()) -> None:
        """Queues `request`; `forks`, further samples of its prompt, start from its prompt pages."""
        request.arrival_index = next(self._arrivals)
        self.waiting.append(request)
        if forks:
            for fork in forks:
                fork.arrival_index = request.arrival_index
            self._forks[request.request_id] = list(forks)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finishes a waiting, running or unforked request and frees its pages; None if it is not here."""
        for queue in (self.waiting, self.running, *self._forks.values()):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.allocator.free(request_id)
                    request.finish(reason)
                    self._forks = {first: forks for first, forks in self._forks.items() if forks}
                    return request
        return None

    # ---- scheduling -----------------------------------------------------------------------------

    @staticmethod
    def _priority_rank(request: Request) -> tuple:
        return not request.promoted, 0 if request.promoted else request.priority, request.arrival_index

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        copies: dict[str, list[tuple[int, int]]] = {}
        preempted: list[str] = []
        config = self.config
        for request in sorted(self.running, key=self.rank):
            if request.status is not RequestStatus.RUNNING or request.placeholder_finishes:
                continue  # preempted to make room for a better-ranked one, or ends when read back
            num_tokens = request.num_uncomputed_tokens
            if num_tokens != 1 or budget < 1:   # a decode's one token fits and costs 1, without the calls
                num_tokens = config.largest_chunk(num_tokens, budget)
                if num_tokens == 0:
                    break
            request_copies = self._allocate_or_preempt(request, num_tokens, preempted)
            if request_copies is None:
                continue
            scheduled[request.request_id] = (request, num_tokens)
            if request_copies:
                copies[request.request_id] = request_copies
            budget -= 1 if num_tokens == 1 else config.chunk_cost(num_tokens)
        for victim in preempted:
            scheduled.pop(victim, None)
            copies.pop(victim, None)
        self.waiting.sort(key=self.rank)
        i = 0
        while i < len(self.waiting) and budget > 0 and not preempted:
            request = self.waiting[i]
            if not self._has_seats_for(request):
                break
            if not self._lora_fits(request):
                if request.promoted:   # it has waited long enough: nobody goes ahead of it any more
                    break
                i += 1                 # its adapter waits for a slot; others may run meanwhile
                continue
            num_tokens = self._admit(request, budget)
            if num_tokens == 0:
                break
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            scheduled[request.request_id] = (request, num_tokens)
            budget -= self.config.chunk_cost(num_tokens)
        self._age_waiting()
        drafts = self._speculate(scheduled, copies, budget) if self.config.speculative and not preempted else {}
        sequences = []
        for request_id, (request, num_tokens) in scheduled.items():
            sequence = self._describe(request, num_tokens, drafts.get(request_id, ()))
            sequences.append(sequence)
            # The chunk counts as computed, and its sample, if it makes one, as a placeholder: so the
            # next step can be scheduled before this one is read back (async scheduling).
            request.num_computed_tokens += num_tokens
            if sequence.samples:
                request.num_placeholders += 1
        return SchedulerOutput(tuple(sequences), tuple(preempted), tuple(c for cs in copies.values() for c in cs))

    def _speculate(self, scheduled: dict[str, tuple[Request, int]], copies: dict[str, list[tuple[int, int]]],
                   budget: int) -> dict[str, tuple[int, ...]]:
        """Drafts for the decodes of a step of at most `disable_by_batch_size` sequences (prompt
        chunks among them or not), within the token budget left; pages for them only where free."""
        spec = self.config.speculative
        if len(scheduled) > spec.disable_by_batch_size or any(r.num_placeholders for r, _ in scheduled.values()):
            return {}
        candidates, rooms = [], []
        for request_id, (request, num_tokens) in scheduled.items():
            if num_tokens != 1 or request.num_uncomputed_tokens != 1:
                continue   # a prompt chunk
            p = request.params
            # min_tokens masks EOS per position: not speculated (a grammar's drafts are cut to what
            # it allows, and masked per row: structured_output.ConstrainedProposals)
            room = min(spec.num_speculative_tokens, budget, request.max_total_tokens - request.num_tokens - 1,
                       (p.max_tokens or request.max_total_tokens) - request.num_output_tokens - 1)
            if room < 1 or request.num_output_tokens < p.min_tokens:
                continue
            extra = self.allocator.allocate(request_id, request.num_tokens + room,
                                            write_from=request.num_computed_tokens)
            if extra is None:
                continue
            copies.setdefault(request_id, []).extend(extra)   # admitted this step: none yet
            candidates.append(request)
            rooms.append(room)
            budget -= room
        if not candidates:
            return {}
        tables = [self.allocator.block_table(r.request_id) for r in candidates]
        drafts = {}
        for request, proposed in zip(candidates, self.proposer.propose(candidates, rooms, tables, self.data_slice)):
            self.allocator.truncate(request.request_id, request.num_tokens + len(proposed))
            if proposed:
                drafts[request.request_id] = proposed
                self.counters.spec_decode_num_drafts += 1
                self.counters.spec_decode_num_draft_tokens += len(proposed)
        return drafts

    def _lora_fits(self, request: Request) -> bool:
        """Whether `request`'s adapter runs already or a slot is left for it (max_loras)."""
        if not request.lora_id:
            return True
        running = {r.lora_id for peer in self.peers for r in peer.running if r.lora_id}
        return request.lora_id in running or len(running) < self.config.max_loras

    def _has_seats_for(self, request: Request) -> bool:
        """Room in max_num_seqs for `request`, its forks, and the forks of running requests."""
        reserved = sum(len(self._forks.get(r.request_id, ())) for r in self.running)
        needed = 1 + len(self._forks.get(request.request_id, ()))
        return len(self.running) + reserved + needed <= self.config.max_num_seqs

    def _admit(self, request: Request, budget: int) -> int:
        """Takes `request`'s cached prefix and pages for its first chunk; the chunk's size, 0 if it
        does not fit (and then it holds nothing)."""
        page_size = self.allocator.page_size
        cacheable = (request.num_tokens - 1) // page_size
        # prompt_logprobs need every prompt position's logits, so such a request computes its whole
        # prompt (as vLLM does); its pages still serve others.
        reads_cache = self.allocator.enable_caching and request.params.prompt_logprobs is None
        hashes = request.page_hashes(page_size)[:cacheable] if reads_cache else []
        hits = self.allocator.match_prefix(request.request_id, hashes)
        request.num_computed_tokens = hits * page_size
        self._release_behind_window(request)
        num_tokens = self.config.largest_chunk(request.num_uncomputed_tokens, budget)
        if num_tokens == 0 or self.allocator.allocate(
                request.request_id, request.num_computed_tokens + num_tokens) is None:
            self.allocator.free(request.request_id)
            request.num_computed_tokens = 0
            return 0
        if request.num_cached_tokens is None:   # a preempted request's readmission keeps the first count
            request.num_cached_tokens = request.num_computed_tokens
        if self.allocator.enable_caching:
            self.counters.prefix_cache_queries += request.num_tokens
            self.counters.prefix_cache_hits += request.num_computed_tokens
        return num_tokens

    def _age_waiting(self) -> None:
        for request in self.waiting:
            request.steps_waited += 1
            request.promoted = request.promoted or request.steps_waited >= self.config.max_wait_steps

    def _allocate_or_preempt(self, request: Request, num_tokens: int,
                             preempted: list[str]) -> list[tuple[int, int]] | None:
        """Pages for `request`'s chunk, preempting the worst-ranked running requests if needed;
        the page copies to make first. None if `request` itself had to be preempted."""
        if self.config.sliding_window:
            self._release_behind_window(request)
        while True:
            copies = self.allocator.allocate(request.request_id, request.num_computed_tokens + num_tokens,
                                             write_from=request.num_computed_tokens)
            if copies:   # a draft model's K/V is not copied: it recomputes the copied pages' tokens
                page_start = request.num_computed_tokens // self.allocator.page_size * self.allocator.page_size
                request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, page_start)
            if copies is not None:
                return copies
            victim = max(self.running, key=self.rank)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None

    def _release_behind_window(self, request: Request) -> None:
        """Returns the pages no query of `request` will see again to the pool: its next chunk's
        first query, at `num_computed_tokens` = p, sees keys from p - W + 1 on. The key at p - W is
        kept too: the other samples of a prompt fork from its first sample's pages once that one's
        decode (at p = the prompt's length) is scheduled, and recompute the prompt's last token,
        whose window starts one key earlier. A step still in flight may read released pages, but
        the device runs it before any later write to them."""
        if self.config.sliding_window:
            self.allocator.release_before(request.request_id,
                                          request.num_computed_tokens - self.config.sliding_window)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed_tokens = request.num_draft_computed_tokens = 0
        request.num_placeholders = 0   # its launched sample is dropped when read back, and made again
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.counters.num_preemptions += 1

    def _describe(self, request: Request, num_tokens: int, drafts: tuple[int, ...] = ()) -> ScheduledSequence:
        start = request.num_computed_tokens
        p = request.params
        # A placeholder is only ever a decode's one token; its id is read on the device (0 here),
        # and so is its place in a penalised request's history (sampler.PLACEHOLDER).
        placeholder = request.num_placeholders > 0
        if placeholder and (num_tokens != 1 or p.penalizes and request.num_placeholders > 1):
            raise AssertionError(f"{request.request_id}: {request.num_placeholders} placeholders in a "
                                 f"{num_tokens}-token chunk{' of a penalised request' if p.penalizes else ''}")
        num_output_tokens = request.num_output_tokens
        sequence = ScheduledSequence(
            request.request_id, (0,) if placeholder else (*request.token_slice(start, start + num_tokens), *drafts),
            start, self.allocator.table_snapshot(request.request_id), start + num_tokens == request.num_tokens,
            p, request.seed, num_output_tokens)
        # What few sequences have is set apart: the usual decode's eight fields given by position
        # took 0.25 us, all sixteen by keyword 0.84 us (256 sequences a step).
        sequence.placeholder, sequence.data_slice, sequence.lora_id = placeholder, self.data_slice, request.lora_id
        if drafts:
            sequence.draft_token_ids = drafts
        if p.penalizes:
            sequence.history, sequence.num_prompt_tokens = request.known_token_array(), len(request.prompt_token_ids)
        if num_output_tokens < p.min_tokens:
            sequence.suppressed_token_ids = (*(() if p.ignore_eos else request.eos_token_ids), *p.stop_token_ids)
        if p.prompt_logprobs is not None:
            sequence.prompt_targets = tuple(request.prompt_token_ids[start + 1:start + num_tokens + 1])
        return sequence

    # ---- after the step -------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> dict[Request, tuple[int, ...]]:
        """After a step is read back: appends each scheduled request's sampled tokens (one, or with
        drafts the confirmed ones and one more) until one ends it, registers its full pages up to
        what is computed in the prefix cache, forks its samples, retires the finished. Returns the
        requests that received tokens, and those tokens. A request that finished, was aborted or was
        preempted after the step was launched is no longer running, and its tokens are dropped."""
        by_id = {r.request_id: r for r in self.running}
        advanced, caching, page_size = {}, self.allocator.enable_caching, self.allocator.page_size
        for seq in output.sequences:
            request = by_id.get(seq.request_id)
            if request is None:
                continue  # finished, aborted or preempted since the step was launched
            if not seq.samples:
                if caching:
                    self._cache_computed_pages(request, seq.start_position + seq.num_tokens)
                continue
            run, taken = sampled[seq.request_id], 0
            for token in run:   # a running request has not finished: the first token is always taken
                taken += 1
                if request.append_token(token):   # it ended the request
                    break
            if seq.draft_token_ids:
                self._count_accepted(len(run) - 1)
                request.num_computed_tokens += taken - 1   # the confirmed drafts' K/V is the sequence's
                self.allocator.truncate(request.request_id, request.num_tokens)
            if caching:   # the K/V the step wrote, of the confirmed drafts only
                computed = seq.start_position + len(seq.token_ids) - len(seq.draft_token_ids) + taken - 1
                # only once a page has filled (a decode: 1 step in page_size) are there hashes to offer
                if computed // page_size > self.allocator.num_offered(request.request_id):
                    self._cache_computed_pages(request, computed)
            advanced[request] = tuple(run) if taken == len(run) else tuple(run[:taken])   # a tuple: itself
            if self._forks:
                self._fork_samples(request)
            if request.is_finished:
                self.running.remove(request)
                self.allocator.free(request.request_id)
        return advanced

    def _count_accepted(self, accepted: int) -> None:
        counters = self.counters
        counters.spec_decode_num_accepted_tokens += accepted
        per_position = counters.spec_decode_num_accepted_tokens_per_pos
        per_position += [0] * (self.config.speculative.num_speculative_tokens - len(per_position))
        for i in range(accepted):
            per_position[i] += 1

    def _cache_computed_pages(self, request: Request, computed: int) -> None:
        """Pages wholly inside the first `computed` tokens: those a step read back has written.
        (A later step may be in flight: its pages wait for its own update.) With prefix caching only."""
        page_size = self.allocator.page_size
        hashes = request.page_hashes(page_size)
        self.allocator.cache_pages(request.request_id, hashes, min(computed // page_size, len(hashes)))

    def _fork_samples(self, first: Request) -> None:
        """The other samples of `first`'s prompt start running, on its prompt pages."""
        prompt_len = len(first.prompt_token_ids)
        for fork in self._forks.pop(first.request_id, ()):
            self.allocator.fork(first.request_id, fork.request_id, prompt_len)
            fork.num_computed_tokens = prompt_len - 1
            fork.status = RequestStatus.RUNNING
            self.running.append(fork)
